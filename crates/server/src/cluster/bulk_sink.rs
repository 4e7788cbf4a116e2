//! A replay of a tablet's backup logs loaded into an engine tablet through the engine's bulk
//! path (`Engine::bulk_restore`): what a recovery's restore and a mirror's (or a move target's)
//! build share.

use ramlog_backup::ReplayEntry;
use ramlog_logmem::{BulkRestore, Engine, EngineError, TabletId};

/// The loader, made for the count the replay announces, and the first error: after it the rest
/// of the replay only reads, and the load has failed.
pub struct BulkSink<'e> {
    engine: &'e Engine,
    tablet: TabletId,
    loader: Option<BulkRestore<'e>>,
    first_error: Option<EngineError>,
}

impl<'e> BulkSink<'e> {
    pub fn new(engine: &'e Engine, tablet: TabletId) -> Self {
        BulkSink {
            engine,
            tablet,
            loader: None,
            first_error: None,
        }
    }

    /// The replay found about `expected` keys: the loader grows the index once, for them.
    pub fn start(&mut self, expected: u64) {
        match self.engine.bulk_restore(self.tablet, expected) {
            Ok(l) => self.loader = Some(l),
            Err(e) => {
                self.first_error.get_or_insert(e);
            }
        }
    }

    /// Loads one replayed entry; false when it is not loaded (the load has failed, or has not
    /// started).
    pub fn push(&mut self, e: &ReplayEntry<'_>) -> bool {
        let Some(l) = self.loader.as_mut().filter(|_| self.first_error.is_none()) else {
            return false;
        };
        if let Err(err) = l.push(e.key, e.value, e.version, e.expiry) {
            self.first_error.get_or_insert(err);
        }
        true
    }

    /// Ends the load: the first error, if any.
    pub fn finish(self) -> Result<(), EngineError> {
        if let Some(e) = self.first_error {
            return Err(e);
        }
        if let Some(l) = self.loader {
            l.finish()?;
        }
        Ok(())
    }
}
