//! Child processes killed -9 when dropped, and waiting for a condition with a limit.

use anyhow::bail;
use std::process::Child;
use std::time::{Duration, Instant};

/// A child process, killed -9 and reaped when dropped (std signals nothing once it is reaped).
pub(super) struct Proc(pub(super) Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `ready` every 50 ms until it says yes, for at most `limit`; an error from `ready` counts
/// as "not yet" and is reported if time runs out.
pub(super) fn wait_until(
    what: &str,
    limit: Duration,
    mut ready: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let last = match ready() {
            Ok(true) => return Ok(()),
            Ok(false) => String::new(),
            Err(e) => format!(" ({e:#})"),
        };
        if Instant::now() > deadline {
            bail!("{what} within {limit:?}{last}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
