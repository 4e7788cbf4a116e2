//! Key → slot mapping, identical to Redis Cluster's so that cluster-aware clients route by themselves.

/// Number of hash slots in the key space.
pub const SLOT_COUNT: u16 = 16384;

/// CRC16/XMODEM (polynomial 0x1021, initial value 0), the checksum Redis Cluster uses. Eight
/// bytes at a time, each through its own table, so that the eight lookups do not wait on one
/// another (slice-by-8); the bytes left over one table lookup each. Every request routes by it,
/// some more than once, and a restore computes it for every key of the logs it reads.
pub fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        // The register's two bytes fold into the first two of the chunk (the CRC is linear,
        // and this one is not reflected: its high byte meets the next byte first).
        let t = &CRC16_TABLES;
        crc = t[7][usize::from((crc >> 8) as u8 ^ c[0])]
            ^ t[6][usize::from(crc as u8 ^ c[1])]
            ^ t[5][usize::from(c[2])]
            ^ t[4][usize::from(c[3])]
            ^ t[3][usize::from(c[4])]
            ^ t[2][usize::from(c[5])]
            ^ t[1][usize::from(c[6])]
            ^ t[0][usize::from(c[7])];
    }
    for &byte in chunks.remainder() {
        crc = (crc << 8) ^ CRC16_TABLES[0][usize::from((crc >> 8) as u8 ^ byte)];
    }
    crc
}

/// `CRC16_TABLES[k][b]`: the CRC16/XMODEM of byte `b` followed by `k` zero bytes, from a zero
/// register. Row 0 is the classic one-byte table.
static CRC16_TABLES: [[u16; 256]; 8] = crc16_tables();

const fn crc16_tables() -> [[u16; 256]; 8] {
    let mut tables = [[0u16; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        tables[0][i] = crc;
        i += 1;
    }
    let mut k = 1;
    while k < 8 {
        let mut i = 0;
        while i < 256 {
            // One more zero byte after the `k - 1` ones.
            let prev = tables[k - 1][i];
            tables[k][i] = (prev << 8) ^ tables[0][(prev >> 8) as usize];
            i += 1;
        }
        k += 1;
    }
    tables
}

/// The first bytes of every internal key: the chunks of large collections (docs/formats.md,
/// "Large collections"). Clients may not use keys that begin with them.
pub const INTERNAL_PREFIX: [u8; 3] = [0xFF, b'r', 0x00];

/// Whether `key` is an internal key ([`INTERNAL_PREFIX`] and the 2-byte slot it belongs to).
#[inline]
pub fn is_internal(key: &[u8]) -> bool {
    key.len() >= INTERNAL_PREFIX.len() + 2 && key[..INTERNAL_PREFIX.len()] == INTERNAL_PREFIX
}

/// Whether a client's key begins with the reserved [`INTERNAL_PREFIX`] (and must be refused).
#[inline]
pub fn is_reserved(key: &[u8]) -> bool {
    key.starts_with(&INTERNAL_PREFIX)
}

/// The slot of `key`: CRC16 of the key, or of the first non-empty `{...}` section (a hash tag).
/// An internal key names its slot (big-endian, after the prefix), so that it lives with the
/// collection it belongs to.
pub fn key_slot(key: &[u8]) -> u16 {
    if is_internal(key) {
        let at = INTERNAL_PREFIX.len();
        return u16::from_be_bytes([key[at], key[at + 1]]) % SLOT_COUNT;
    }
    let hashed = hash_tag(key).unwrap_or(key);
    crc16_xmodem(hashed) % SLOT_COUNT
}

fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    let open = key.iter().position(|&b| b == b'{')?;
    let close_rel = key[open + 1..].iter().position(|&b| b == b'}')?;
    if close_rel == 0 {
        return None;
    }
    Some(&key[open + 1..open + 1 + close_rel])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bit-at-a-time definition the table is built from.
    fn crc16_bitwise(data: &[u8]) -> u16 {
        let mut crc: u16 = 0;
        for &byte in data {
            crc ^= (byte as u16) << 8;
            for _ in 0..8 {
                crc = if crc & 0x8000 != 0 {
                    (crc << 1) ^ 0x1021
                } else {
                    crc << 1
                };
            }
        }
        crc
    }

    #[test]
    fn the_table_matches_the_bitwise_definition() {
        let data: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        for len in (0..=40).chain([100, 4095, 4096]) {
            assert_eq!(
                crc16_xmodem(&data[..len]),
                crc16_bitwise(&data[..len]),
                "{len}"
            );
        }
        for b in 0..=255u8 {
            assert_eq!(crc16_xmodem(&[b]), crc16_bitwise(&[b]));
        }
    }

    #[test]
    fn crc16_reference_vector() {
        // The check value of CRC-16/XMODEM.
        assert_eq!(crc16_xmodem(b"123456789"), 0x31C3);
    }

    #[test]
    fn slots_match_redis_cluster() {
        // Values as printed by `redis-cli CLUSTER KEYSLOT`.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(
            key_slot(b"{user1000}.following"),
            key_slot(b"{user1000}.followers")
        );
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        // An empty tag hashes the whole key.
        assert_eq!(
            key_slot(b"foo{}{bar}"),
            crc16_xmodem(b"foo{}{bar}") % SLOT_COUNT
        );
        // Only the first tag counts.
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
    }

    #[test]
    fn internal_keys_name_their_slot() {
        let mut k = INTERNAL_PREFIX.to_vec();
        k.extend_from_slice(&12182u16.to_be_bytes());
        k.extend_from_slice(b"anything after it");
        assert!(is_internal(&k) && is_reserved(&k));
        assert_eq!(key_slot(&k), 12182);
        // Too short to name a slot: hashed as any key, but still reserved.
        assert!(!is_internal(&INTERNAL_PREFIX) && is_reserved(&INTERNAL_PREFIX));
        assert!(!is_reserved(b"\xffr") && !is_reserved(b"foo"));
    }
}
