//! The Lua script bodies a server knows (EVAL, SCRIPT LOAD), by SHA1; `front::commands::scripting`
//! runs them.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// The script running now, if any (scripts run one at a time: they hold the gate alone).
    pub running: Arc<Running>,
}

/// The script that runs now: when it started, whether it has written, and whether SCRIPT KILL
/// asked it to stop (its Lua hook checks every few thousand instructions).
#[derive(Default)]
pub struct Running {
    /// Milliseconds since the epoch at its start; 0 when no script runs.
    started_ms: AtomicU64,
    wrote: AtomicBool,
    kill: AtomicBool,
}

/// What SCRIPT KILL found.
#[derive(Debug, PartialEq, Eq)]
pub enum Kill {
    /// No script runs.
    NotBusy,
    /// The running script has written: stopping it would leave half its effects.
    Unkillable,
    /// The script stops at its next check.
    Killed,
}

impl Running {
    pub fn start(&self, now_ms: u64) {
        self.wrote.store(false, Ordering::Release);
        self.kill.store(false, Ordering::Release);
        self.started_ms.store(now_ms.max(1), Ordering::Release);
    }

    pub fn end(&self) {
        self.started_ms.store(0, Ordering::Release);
        self.kill.store(false, Ordering::Release);
    }

    /// How long the running script has run, if one does.
    pub fn running_for_ms(&self, now_ms: u64) -> Option<u64> {
        match self.started_ms.load(Ordering::Acquire) {
            0 => None,
            t => Some(now_ms.saturating_sub(t)),
        }
    }

    pub fn note_write(&self) {
        self.wrote.store(true, Ordering::Release);
    }

    pub fn kill_requested(&self) -> bool {
        self.kill.load(Ordering::Acquire)
    }

    /// SHUTDOWN: the running script stops at its next check, whether it has written or not.
    pub fn stop(&self) {
        self.kill.store(true, Ordering::Release);
    }

    /// SCRIPT KILL.
    pub fn kill(&self) -> Kill {
        if self.started_ms.load(Ordering::Acquire) == 0 {
            return Kill::NotBusy;
        }
        if self.wrote.load(Ordering::Acquire) {
            return Kill::Unkillable;
        }
        self.kill.store(true, Ordering::Release);
        Kill::Killed
    }
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

#[cfg(test)]
mod running_tests {
    use super::*;

    #[test]
    fn script_kill_follows_redis_rules() {
        let r = Running::default();
        assert_eq!(r.kill(), Kill::NotBusy);
        assert_eq!(r.running_for_ms(500), None);
        r.start(100);
        assert_eq!(r.running_for_ms(150), Some(50));
        r.note_write();
        assert_eq!(r.kill(), Kill::Unkillable);
        assert!(!r.kill_requested());
        // SHUTDOWN stops even a script that has written.
        r.stop();
        assert!(r.kill_requested());
        r.end();
        r.start(200);
        assert!(
            !r.kill_requested(),
            "a new script starts without the last one's kill"
        );
        assert_eq!(r.kill(), Kill::Killed);
        assert!(r.kill_requested());
        r.end();
        assert_eq!(r.kill(), Kill::NotBusy);
    }
}
