//! Redis's integer syntax (`string2ll`), as INCR, EXPIRE, SETRANGE and the other commands that take
//! or hold a number read it.

/// Parses `bytes` the way Redis's `string2ll` does: an optional '-', then digits, no '+', no
/// spaces, no leading zeros (only "0" itself starts with one, so "-0" is refused), and the value
/// fits in an i64. At most 20 bytes are read; anything longer is refused without parsing.
pub fn parse_redis_i64(bytes: &[u8]) -> Option<i64> {
    if bytes.is_empty() || bytes.len() > 20 {
        return None;
    }
    if bytes == b"0" {
        return Some(0);
    }
    let (negative, digits) = match bytes[0] {
        b'-' => (true, &bytes[1..]),
        _ => (false, bytes),
    };
    if digits.is_empty() || digits[0] == b'0' {
        return None;
    }
    let mut value: u64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        value = value.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
    }
    if negative {
        if value > i64::MAX as u64 + 1 {
            None
        } else {
            Some((value as i64).wrapping_neg())
        }
    } else {
        i64::try_from(value).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::parse_redis_i64;

    #[test]
    fn redis_integer_rules() {
        assert_eq!(parse_redis_i64(b"0"), Some(0));
        assert_eq!(parse_redis_i64(b"-12"), Some(-12));
        assert_eq!(parse_redis_i64(b"9223372036854775807"), Some(i64::MAX));
        assert_eq!(parse_redis_i64(b"-9223372036854775808"), Some(i64::MIN));
        for bad in [
            &b""[..],
            b"+1",
            b" 1",
            b"1 ",
            b"01",
            b"-0",
            b"1.0",
            b"9223372036854775808",
            b"abc",
            b"-",
            b"-01",
            b"-9223372036854775809",
            b"18446744073709551616",  // past u64 too
            b"99999999999999999999",  // 20 digits
            b"123456789012345678901", // 21 bytes
        ] {
            assert_eq!(
                parse_redis_i64(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
