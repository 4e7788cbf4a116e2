//! LEB128 varints (7 bits a byte, low bits first, the high bit set on every byte but the last),
//! as the engine's log entries and the backup's entry headers write them. Each format decodes
//! with its own bounds and error type; these are the shared encoding halves.

/// Bytes `v` takes as a varint (1 to 10).
#[inline]
pub fn len(v: u64) -> usize {
    let bits = 64 - (v | 1).leading_zeros() as usize;
    bits.div_ceil(7)
}

/// Writes `v` at `out[pos..]`; returns the position after it. `out` must have `len(v)` bytes
/// there.
#[inline]
pub fn put(out: &mut [u8], mut pos: usize, mut v: u64) -> usize {
    while v >= 0x80 {
        out[pos] = (v as u8) | 0x80;
        v >>= 7;
        pos += 1;
    }
    out[pos] = v as u8;
    pos + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_match_what_is_written() {
        let mut buf = [0u8; 10];
        for v in [0u64, 1, 127, 128, 16_383, 16_384, 1 << 35, u64::MAX] {
            let end = put(&mut buf, 0, v);
            assert_eq!(end, len(v), "{v}");
            // Every byte but the last carries the continuation bit.
            assert!(buf[..end - 1].iter().all(|b| b & 0x80 != 0));
            assert_eq!(buf[end - 1] & 0x80, 0);
        }
        assert_eq!(len(u64::MAX), 10);
    }
}
