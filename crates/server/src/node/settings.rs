//! Settings a client may change at run time with CONFIG SET (everything else is configured by
//! file, flags and environment at start and is read-only to CONFIG).
//!
//! These are Redis's collection encoding thresholds, which decide when a list, hash or set takes
//! the large form (docs/architecture.md, "The Redis data types"), `notify-keyspace-events`, and
//! `busy-reply-threshold` (`lua-time-limit`), past which a running script makes others' commands
//! answer `-BUSY`.
//! Redis clients and tools (and Redis's own test suite) set them.

use parking_lot::Mutex;

/// A settable parameter: its name, the Redis 6 alias, its default and how a value is checked.
struct Param {
    name: &'static str,
    alias: Option<&'static str>,
    default: i64,
    min: i64,
    max: i64,
}

const PARAMS: &[Param] = &[
    Param {
        name: "hash-max-listpack-entries",
        alias: Some("hash-max-ziplist-entries"),
        default: 128,
        min: 0,
        max: i64::MAX,
    },
    Param {
        name: "hash-max-listpack-value",
        alias: Some("hash-max-ziplist-value"),
        default: 64,
        min: 0,
        max: i64::MAX,
    },
    Param {
        name: "set-max-intset-entries",
        alias: None,
        default: 512,
        min: 0,
        max: i64::MAX,
    },
    Param {
        name: "set-max-listpack-entries",
        alias: None,
        default: 128,
        min: 0,
        max: i64::MAX,
    },
    Param {
        name: "set-max-listpack-value",
        alias: None,
        default: 64,
        min: 0,
        max: i64::MAX,
    },
    Param {
        name: "zset-max-listpack-entries",
        alias: Some("zset-max-ziplist-entries"),
        default: 128,
        min: 0,
        max: i64::MAX,
    },
    Param {
        name: "zset-max-listpack-value",
        alias: Some("zset-max-ziplist-value"),
        default: 64,
        min: 0,
        max: i64::MAX,
    },
    Param {
        name: "list-max-listpack-size",
        alias: Some("list-max-ziplist-size"),
        default: -2,
        min: i64::MIN,
        max: i64::MAX,
    },
    Param {
        name: "list-compress-depth",
        alias: None,
        default: 0,
        min: 0,
        max: i64::MAX,
    },
    Param {
        name: "busy-reply-threshold",
        alias: Some("lua-time-limit"),
        default: 5000,
        min: 0,
        max: i64::MAX,
    },
    Param {
        name: "stream-node-max-bytes",
        alias: None,
        default: 4096,
        min: 0,
        max: i64::MAX,
    },
    Param {
        name: "stream-node-max-entries",
        alias: None,
        default: 100,
        min: 0,
        max: i64::MAX,
    },
];

/// When a list leaves its compact form ([`RuntimeSettings::list_limit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListLimit {
    Bytes(usize),
    Entries(usize),
}

/// The current values of [`PARAMS`], in its order, and the keyspace notification classes.
pub struct RuntimeSettings {
    values: Mutex<Vec<i64>>,
    /// `notify-keyspace-events` as flags (`super::keyspace_events`); 0, Redis's default, is off.
    notify: std::sync::atomic::AtomicU32,
}

impl Default for RuntimeSettings {
    fn default() -> Self {
        RuntimeSettings {
            values: Mutex::new(PARAMS.iter().map(|p| p.default).collect()),
            notify: std::sync::atomic::AtomicU32::new(0),
        }
    }
}

/// The setting of keyspace notifications (a string of event classes, as Redis's).
pub const NOTIFY: &str = "notify-keyspace-events";

fn index_of(name: &str) -> Option<usize> {
    PARAMS.iter().position(|p| {
        p.name.eq_ignore_ascii_case(name) || p.alias.is_some_and(|a| a.eq_ignore_ascii_case(name))
    })
}

impl RuntimeSettings {
    /// Every parameter with its value, aliases included (CONFIG GET matches either name).
    pub fn all(&self) -> Vec<(&'static str, String)> {
        let values = self.values.lock();
        let mut out = Vec::new();
        for (p, v) in PARAMS.iter().zip(values.iter()) {
            out.push((p.name, v.to_string()));
            if let Some(alias) = p.alias {
                out.push((alias, v.to_string()));
            }
        }
        out.push((NOTIFY, super::keyspace_events::format_flags(self.notify())));
        out
    }

    /// The keyspace notification flags (`super::keyspace_events`).
    #[inline]
    pub fn notify(&self) -> u32 {
        self.notify.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The current value of parameter `name` (its default if there is no such parameter).
    pub fn value(&self, name: &str) -> i64 {
        index_of(name).map_or(0, |i| self.values.lock()[i])
    }

    /// The bytes past which a list takes the large form, or its element count when
    /// `list-max-listpack-size` is positive (Redis's rule: -1 to -5 are 4 to 64 KiB).
    pub fn list_limit(&self) -> ListLimit {
        // As Redis: 0 counts as 1 entry, and below -5 as -5.
        match self.value("list-max-listpack-size") {
            n if n > 0 => ListLimit::Entries(n as usize),
            0 => ListLimit::Entries(1),
            n => ListLimit::Bytes(4096usize << (n.unsigned_abs().min(5) - 1)),
        }
    }

    /// Whether `name` is a parameter CONFIG SET may change.
    pub fn is_settable(name: &str) -> bool {
        index_of(name).is_some() || name.eq_ignore_ascii_case(NOTIFY)
    }

    /// Sets every `(name, value)` pair, or none of them: the first bad pair's error otherwise.
    pub fn set_all(&self, pairs: &[(&str, &str)]) -> Result<(), String> {
        let mut parsed = Vec::with_capacity(pairs.len());
        let mut notify = None;
        for (name, value) in pairs {
            if name.eq_ignore_ascii_case(NOTIFY) {
                let flags = super::keyspace_events::parse_flags(value).ok_or_else(|| {
                    format!("Invalid event class character. Use 'Ag$lshzxeKEtmdn'. ('{name}')")
                })?;
                notify = Some(flags);
                continue;
            }
            let i = index_of(name).ok_or_else(|| format!("Unknown option '{name}'"))?;
            let p = &PARAMS[i];
            let v: i64 = value
                .parse()
                .map_err(|_| format!("argument couldn't be parsed into an integer ('{name}')"))?;
            if v < p.min || v > p.max {
                return Err(format!(
                    "argument must be between {} and {} inclusive ('{name}')",
                    p.min, p.max
                ));
            }
            parsed.push((i, v));
        }
        let mut values = self.values.lock();
        for (i, v) in parsed {
            values[i] = v;
        }
        if let Some(flags) = notify {
            self.notify
                .store(flags, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_is_all_or_nothing_and_aliases_share_a_value() {
        let s = RuntimeSettings::default();
        s.set_all(&[("hash-max-ziplist-entries", "7")]).unwrap();
        let all = s.all();
        assert!(all.contains(&("hash-max-listpack-entries", "7".to_string())));
        assert!(all.contains(&("hash-max-ziplist-entries", "7".to_string())));
        let err = s
            .set_all(&[
                ("zset-max-listpack-entries", "3"),
                ("zset-max-listpack-value", "-1"),
            ])
            .unwrap_err();
        assert!(err.contains("between 0"), "{err}");
        assert!(s
            .all()
            .contains(&("zset-max-listpack-entries", "128".to_string())));
        assert!(s.set_all(&[("maxmemory", "1")]).is_err());
        assert!(s.set_all(&[("set-max-intset-entries", "x")]).is_err());
        // Redis's list rules: 0 is one entry, below -5 is -5.
        s.set_all(&[("list-max-listpack-size", "0")]).unwrap();
        assert_eq!(s.list_limit(), ListLimit::Entries(1));
        s.set_all(&[("list-max-listpack-size", "-6")]).unwrap();
        assert_eq!(s.list_limit(), ListLimit::Bytes(65536));
        s.set_all(&[("list-max-listpack-size", "-2")]).unwrap();
        assert_eq!(s.list_limit(), ListLimit::Bytes(8192));
    }
}
