//! The Lua script bodies a server knows (EVAL, SCRIPT LOAD), by SHA1; `front::commands::scripting`
//! runs them.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Most bytes of script bodies a server keeps (INFO memory's `scripts` part). Past it, a new
/// script is refused until SCRIPT FLUSH; one body is at most [`SCRIPT_BYTES_MAX`].
pub const SCRIPTS_BYTES_MAX: u64 = 64 << 20;
/// Most bytes of one script body.
pub const SCRIPT_BYTES_MAX: usize = 4 << 20;

/// The script bodies, by lower-case hex SHA1.
#[derive(Default)]
pub struct Scripts {
    bodies: Mutex<HashMap<String, Arc<[u8]>>>,
    bytes: AtomicU64,
    /// Bumped by SCRIPT FLUSH: each thread drops its compiled scripts when it sees a new one.
    epoch: AtomicU64,
}

pub fn sha1_hex(body: &[u8]) -> String {
    sha1_smol::Sha1::from(body).digest().to_string()
}

impl Scripts {
    /// Adds a body (if new); its SHA1, or why it is refused.
    pub fn add(&self, body: &[u8]) -> Result<String, String> {
        if body.len() > SCRIPT_BYTES_MAX {
            return Err(format!(
                "ERR script of {} bytes is over the limit of {SCRIPT_BYTES_MAX}",
                body.len()
            ));
        }
        let sha = sha1_hex(body);
        let mut bodies = self.bodies.lock();
        if !bodies.contains_key(&sha) {
            let cost = body.len() as u64 + 40;
            if self.bytes.load(Ordering::Relaxed) + cost > SCRIPTS_BYTES_MAX {
                return Err(format!(
                    "ERR the server's scripts take {SCRIPTS_BYTES_MAX} bytes, its limit: SCRIPT FLUSH first"
                ));
            }
            bodies.insert(sha.clone(), body.into());
            self.bytes.fetch_add(cost, Ordering::Relaxed);
        }
        Ok(sha)
    }

    pub fn get(&self, sha: &str) -> Option<Arc<[u8]>> {
        self.bodies.lock().get(sha).cloned()
    }

    pub fn flush(&self) {
        self.bodies.lock().clear();
        self.bytes.store(0, Ordering::Relaxed);
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Bytes of script bodies held (with their SHA1s).
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha1_matches_redis_and_the_cache_is_bounded() {
        // `redis-cli SCRIPT LOAD "return 1"`.
        assert_eq!(
            sha1_hex(b"return 1"),
            "e0e1f9fabfc9d4800c877a703b823ac0578ff8db"
        );
        let s = Scripts::default();
        assert!(s.add(&vec![b' '; SCRIPT_BYTES_MAX + 1]).is_err());
        let mut added = 0;
        let mut i = 0u32;
        while s
            .add(&[&vec![b' '; SCRIPT_BYTES_MAX - 8][..], &i.to_le_bytes()[..]].concat())
            .is_ok()
        {
            added += 1;
            i += 1;
        }
        assert_eq!(
            added,
            (SCRIPTS_BYTES_MAX / (SCRIPT_BYTES_MAX as u64 + 36)) as usize
        );
        assert!(s.bytes() <= SCRIPTS_BYTES_MAX);
        s.flush();
        assert_eq!(s.bytes(), 0);
        assert!(s.add(b"return 1").is_ok());
    }
}
