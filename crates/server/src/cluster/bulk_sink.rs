//! A replay of a tablet's backup logs loaded into an engine tablet: through the engine's bulk
//! path (`Engine::bulk_restore`) for a merged replay, which yields each key once (what a
//! recovery's restore and a mirror's, or a move target's, build share); or from the threads of
//! a streamed replay, whose merge the engine's index does (`Engine::restore_newest`), for a
//! recovery's restore.

use parking_lot::Mutex;
use ramlog_backup::{ReplayEntry, ReplaySink};
use ramlog_logmem::{BulkRestore, Engine, EngineError, RestoreItem, TabletId};
use std::sync::atomic::{AtomicU64, Ordering};

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

/// The taker of a streamed replay ([`ramlog_backup::Backup::replay_streamed`]): each batch goes
/// into the engine tablet as it comes, the newest version of each key winning there. Counts the
/// entries it took in `objects` and their bytes in `bytes`; `started` hears the count the
/// replay announces, `taken` the running count after each batch and the batch's size. After the first error it
/// stops the replay.
pub struct NewestSink<'e, S, T> {
    engine: &'e Engine,
    tablet: TabletId,
    objects: &'e AtomicU64,
    bytes: &'e AtomicU64,
    started: S,
    taken: T,
    first_error: Mutex<Option<EngineError>>,
}

impl<'e, S: Fn(u64) + Sync, T: Fn(u64, u64) + Sync> NewestSink<'e, S, T> {
    pub fn new(
        engine: &'e Engine,
        tablet: TabletId,
        objects: &'e AtomicU64,
        bytes: &'e AtomicU64,
        started: S,
        taken: T,
    ) -> Self {
        NewestSink {
            engine,
            tablet,
            objects,
            bytes,
            started,
            taken,
            first_error: Mutex::new(None),
        }
    }

    /// The first error the engine gave, if any.
    pub fn error(self) -> Option<EngineError> {
        self.first_error.into_inner()
    }
}

impl<S: Fn(u64) + Sync, T: Fn(u64, u64) + Sync> ReplaySink for NewestSink<'_, S, T> {
    fn start(&self, expected: u64) {
        if let Err(e) = self.engine.reserve_for_restore(self.tablet, expected) {
            self.first_error.lock().get_or_insert(e);
        }
        (self.started)(expected);
    }

    fn take(&self, batch: &[ReplayEntry<'_>]) -> bool {
        if self.first_error.lock().is_some() {
            return false;
        }
        let mut bytes = 0u64;
        let items: Vec<RestoreItem<'_>> = batch
            .iter()
            .map(|e| {
                bytes += (e.key.len() + e.value.len()) as u64;
                RestoreItem {
                    key: e.key,
                    value: Some(e.value),
                    version: e.version,
                    expire_at_ms: e.expiry,
                }
            })
            .collect();
        if let Err(e) = self.engine.restore_newest(self.tablet, &items) {
            self.first_error.lock().get_or_insert(e);
            return false;
        }
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        let n = self
            .objects
            .fetch_add(batch.len() as u64, Ordering::Relaxed)
            + batch.len() as u64;
        (self.taken)(n, batch.len() as u64);
        true
    }
}
