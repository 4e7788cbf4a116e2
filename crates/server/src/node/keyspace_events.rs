//! The classes of keyspace notifications (`notify-keyspace-events`, Redis's `notify.c`): the
//! flags a server keeps in its settings, and the string CONFIG reads and writes them as. The
//! events themselves are published by the commands (`front::commands::notify`).

pub const GENERIC: u32 = 1 << 0; // g
pub const STRING: u32 = 1 << 1; // $
pub const LIST: u32 = 1 << 2; // l
pub const SET: u32 = 1 << 3; // s
pub const HASH: u32 = 1 << 4; // h
pub const ZSET: u32 = 1 << 5; // z
pub const EXPIRED: u32 = 1 << 6; // x
pub const EVICTED: u32 = 1 << 7; // e
pub const STREAM: u32 = 1 << 8; // t
pub const KEY_MISS: u32 = 1 << 9; // m
pub const MODULE: u32 = 1 << 10; // d
pub const NEW: u32 = 1 << 11; // n
pub const KEYSPACE: u32 = 1 << 12; // K
pub const KEYEVENT: u32 = 1 << 13; // E
/// `A`: every class but key misses and new keys.
pub const ALL: u32 =
    GENERIC | STRING | LIST | SET | HASH | ZSET | EXPIRED | EVICTED | STREAM | MODULE;

const CLASSES: [(u8, u32); 11] = [
    (b'g', GENERIC),
    (b'$', STRING),
    (b'l', LIST),
    (b's', SET),
    (b'h', HASH),
    (b'z', ZSET),
    (b'x', EXPIRED),
    (b'e', EVICTED),
    (b't', STREAM),
    (b'd', MODULE),
    (b'n', NEW),
];

/// The flags of a `notify-keyspace-events` string; None for a character Redis does not take.
pub fn parse_flags(text: &str) -> Option<u32> {
    let mut flags = 0;
    for c in text.bytes() {
        flags |= match c {
            b'A' => ALL,
            b'K' => KEYSPACE,
            b'E' => KEYEVENT,
            b'm' => KEY_MISS,
            c => CLASSES.iter().find(|(ch, _)| *ch == c)?.1,
        };
    }
    Some(flags)
}

/// The string CONFIG GET answers for `flags`, as Redis writes it.
pub fn format_flags(flags: u32) -> String {
    let mut out = String::new();
    if flags & ALL == ALL {
        out.push('A');
        if flags & NEW != 0 {
            out.push('n');
        }
    } else {
        for (c, f) in CLASSES {
            if flags & f != 0 {
                out.push(c as char);
            }
        }
    }
    if flags & KEYSPACE != 0 {
        out.push('K');
    }
    if flags & KEYEVENT != 0 {
        out.push('E');
    }
    if flags & KEY_MISS != 0 {
        out.push('m');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_read_and_print_as_redis() {
        assert_eq!(format_flags(parse_flags("gKE").unwrap()), "gKE");
        assert_eq!(format_flags(parse_flags("$lshzxeKE").unwrap()), "$lshzxeKE");
        assert_eq!(format_flags(parse_flags("KA").unwrap()), "AK");
        assert_eq!(format_flags(parse_flags("EA").unwrap()), "AE");
        assert_eq!(format_flags(parse_flags("").unwrap()), "");
        assert_eq!(parse_flags("Kq"), None);
        assert_eq!(parse_flags("An").unwrap() & NEW, NEW);
    }
}
