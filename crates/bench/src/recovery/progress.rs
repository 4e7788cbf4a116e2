//! Progress of the long phases (preloads, the wait for a recovery) on stderr.

use std::io::{self, Write};
use std::time::{Duration, Instant};

/// A one-line progress display on stderr: redrawn in place at most every 250 ms on a terminal,
/// one line every 5 s otherwise.
pub(super) struct Progress {
    label: String,
    last: Option<Instant>,
    terminal: bool,
}

impl Progress {
    pub(super) fn new(label: &str) -> Progress {
        use std::io::IsTerminal;
        Progress {
            label: label.to_string(),
            last: None,
            terminal: io::stderr().is_terminal(),
        }
    }

    pub(super) fn show(&mut self, text: impl FnOnce() -> String) {
        let every = if self.terminal {
            Duration::from_millis(250)
        } else {
            Duration::from_secs(5)
        };
        if self.last.is_some_and(|t| t.elapsed() < every) {
            return;
        }
        self.last = Some(Instant::now());
        if self.terminal {
            eprint!("\r  {}: {:<76}", self.label, text());
        } else {
            eprintln!("  {}: {}", self.label, text());
        }
        let _ = io::stderr().flush();
    }

    pub(super) fn done(&mut self, text: &str) {
        if self.terminal {
            eprintln!("\r  {}: {:<76}", self.label, text);
        } else {
            eprintln!("  {}: {}", self.label, text);
        }
    }
}
