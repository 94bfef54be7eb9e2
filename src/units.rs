//! Sizes as people write them (`256K`, `20G`): the CLI's flags and the configuration's
//! `cache.size`.

use crate::error::{Error, Result};

/// Parses sizes like `256K`, `1M`, `1MiB`, `65536`.
pub fn parse_size(s: &str) -> Result<usize> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().map_err(|_| {
        Error::invalid(format!(
            "size {s:?} is not a number with an optional K, M, G or T suffix"
        ))
    })?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => {
            return Err(Error::invalid(format!(
                "size {s:?}: unknown unit {unit:?} (use K, M, G or T)"
            )))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| Error::invalid(format!("size {s:?} is too large")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("256K").unwrap(), 256 << 10);
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("65536").unwrap(), 65536);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert!(parse_size("1P").is_err());
        assert!(parse_size("abc").is_err());
    }
}
