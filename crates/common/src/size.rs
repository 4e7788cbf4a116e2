//! Parsing of byte sizes written for humans: `1048576`, `64KiB`, `2GiB`, `512mb`.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SizeParseError {
    #[error("empty size")]
    Empty,
    #[error("invalid number in size {0:?}")]
    BadNumber(String),
    #[error("unknown unit {unit:?} in size {input:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")]
    BadUnit { input: String, unit: String },
    #[error("size {0:?} overflows 64 bits")]
    Overflow(String),
}

/// Parses `N[unit]` with binary (KiB, K, KB treated as 1024) multipliers; case-insensitive.
pub fn parse_size_bytes(input: &str) -> Result<u64, SizeParseError> {
    let trimmed = input.trim();
    if trimmed.is_empty() {
        return Err(SizeParseError::Empty);
    }
    let split = trimmed
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    if number.is_empty() {
        return Err(SizeParseError::BadNumber(input.to_string()));
    }
    let unit = unit.trim().to_ascii_lowercase();
    let multiplier: u64 = match unit.as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => {
            return Err(SizeParseError::BadUnit {
                input: input.to_string(),
                unit,
            })
        }
    };
    if number.contains('.') {
        let value: f64 = number
            .parse()
            .map_err(|_| SizeParseError::BadNumber(input.to_string()))?;
        let bytes = value * multiplier as f64;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
            return Err(SizeParseError::Overflow(input.to_string()));
        }
        return Ok(bytes as u64);
    }
    let value: u64 = number
        .parse()
        .map_err(|_| SizeParseError::BadNumber(input.to_string()))?;
    value
        .checked_mul(multiplier)
        .ok_or_else(|| SizeParseError::Overflow(input.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size_bytes("1024"), Ok(1024));
        assert_eq!(parse_size_bytes("64KiB"), Ok(65536));
        assert_eq!(parse_size_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size_bytes("512mb"), Ok(512 << 20));
        assert_eq!(parse_size_bytes("1.5GiB"), Ok(3 << 29));
    }

    #[test]
    fn rejects_garbage() {
        assert_eq!(parse_size_bytes(""), Err(SizeParseError::Empty));
        assert!(matches!(
            parse_size_bytes("12 parsecs"),
            Err(SizeParseError::BadUnit { .. })
        ));
        assert!(matches!(
            parse_size_bytes("abc"),
            Err(SizeParseError::BadNumber(_))
        ));
        assert!(matches!(
            parse_size_bytes("99999999999TiB"),
            Err(SizeParseError::Overflow(_))
        ));
    }
}
