//! Clients blocked on keys (BLPOP, BLMOVE, BZPOPMIN, ...): each blocked connection has its own
//! [`Notify`], registered under each of its keys; a write that may give them something wakes the
//! key's waiters.
//!
//! A write of a collection calls [`KeyWaiters::wake`]; when nobody waits (the common case) that
//! costs one atomic load. A wake is `notify_one` on each waiter's own notifier, which keeps a
//! permit when the waiter is not waiting yet: a push between a waiter's try and its wait is not
//! missed. Waiters also retry on their own every `front::blocking::RETRY_INTERVAL`, which covers
//! what reaches a key by other paths (a restore, a migration's import) and notices a slot that
//! moved away.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;

#[derive(Default)]
pub struct KeyWaiters {
    /// Per key with blocked clients, their notifiers.
    keys: Mutex<HashMap<Vec<u8>, Vec<Arc<Notify>>>>,
    count: AtomicUsize,
    /// Blocked clients by client id, for CLIENT UNBLOCK.
    clients: Mutex<HashMap<u64, Arc<Unblock>>>,
    /// The notifiers of clients that a deletion of their key also ends (XREADGROUP, whose
    /// group goes with the key), by address.
    on_nokey: Mutex<std::collections::HashSet<usize>>,
    /// Keys that clients waiting elsewhere (a routing port's, blocked at the keys' master)
    /// wait on: per key, (clients, of which a deletion of the key ends).
    held: Mutex<HashMap<Vec<u8>, (u32, u32)>>,
}

/// How CLIENT UNBLOCK ends a blocked client's wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnblockAs {
    /// As if its timeout had passed (the null reply).
    Timeout,
    /// With `-UNBLOCKED client unblocked via CLIENT UNBLOCK`.
    Error,
}

/// A blocked client's handle: its notifier and how CLIENT UNBLOCK asked it to end.
pub struct Unblock {
    notify: Arc<Notify>,
    asked: Mutex<Option<UnblockAs>>,
}

impl Unblock {
    /// How the client was asked to end its wait, if it was.
    pub fn asked(&self) -> Option<UnblockAs> {
        *self.asked.lock()
    }
}

impl KeyWaiters {
    /// Records a blocked client (until [`forget_client`](Self::forget_client)), woken through
    /// `notify` by [`unblock`](Self::unblock).
    pub fn block_client(&self, id: u64, notify: &Arc<Notify>) -> Arc<Unblock> {
        let handle = Arc::new(Unblock {
            notify: notify.clone(),
            asked: Mutex::new(None),
        });
        self.clients.lock().insert(id, handle.clone());
        handle
    }

    pub fn forget_client(&self, id: u64) {
        self.clients.lock().remove(&id);
    }

    /// CLIENT UNBLOCK: ends client `id`'s wait as `how`; false if it is not blocked.
    pub fn unblock(&self, id: u64, how: UnblockAs) -> bool {
        let clients = self.clients.lock();
        let Some(handle) = clients.get(&id) else {
            return false;
        };
        let mut asked = handle.asked.lock();
        if asked.is_some() {
            return false;
        }
        *asked = Some(how);
        handle.notify.notify_one();
        true
    }

    /// Marks `notify`'s client as one a deletion of its keys ends too (until unregistered).
    pub fn mark_on_nokey(&self, notify: &Arc<Notify>) {
        self.on_nokey.lock().insert(Arc::as_ptr(notify) as usize);
    }

    /// Keys with blocked clients, and those among them with a client that their deletion ends
    /// (INFO's `total_blocking_keys` and `total_blocking_keys_on_nokey`).
    pub fn blocking_keys(&self) -> (u64, u64) {
        let map = self.keys.lock();
        let on_nokey = self.on_nokey.lock();
        let marked = map
            .values()
            .filter(|list| {
                list.iter()
                    .any(|n| on_nokey.contains(&(Arc::as_ptr(n) as usize)))
            })
            .count();
        (map.len() as u64, marked as u64)
    }

    /// Counts a client that waits on `keys` elsewhere (until [`release`](Self::release));
    /// `on_nokey`: their deletion ends its wait.
    pub fn hold(&self, keys: &[Vec<u8>], on_nokey: bool) {
        let mut held = self.held.lock();
        for k in keys {
            let e = held.entry(k.clone()).or_default();
            e.0 += 1;
            e.1 += u32::from(on_nokey);
        }
    }

    pub fn release(&self, keys: &[Vec<u8>], on_nokey: bool) {
        let mut held = self.held.lock();
        for k in keys {
            if let Some(e) = held.get_mut(k) {
                e.0 = e.0.saturating_sub(1);
                e.1 = e.1.saturating_sub(u32::from(on_nokey));
                if e.0 == 0 {
                    held.remove(k);
                }
            }
        }
    }

    /// [`blocking_keys`](Self::blocking_keys) of the clients counted by [`hold`](Self::hold).
    pub fn held_keys(&self) -> (u64, u64) {
        let held = self.held.lock();
        let nokey = held.values().filter(|e| e.1 > 0).count();
        (held.len() as u64, nokey as u64)
    }

    /// Registers `notify` under every key (until [`unregister`](Self::unregister)).
    pub fn register(&self, keys: &[Vec<u8>], notify: &Arc<Notify>) {
        let mut map = self.keys.lock();
        for k in keys {
            map.entry(k.clone()).or_default().push(notify.clone());
        }
        self.count.store(map.len(), Ordering::Release);
    }

    pub fn unregister(&self, keys: &[Vec<u8>], notify: &Arc<Notify>) {
        self.on_nokey.lock().remove(&(Arc::as_ptr(notify) as usize));
        let mut map = self.keys.lock();
        for k in keys {
            if let Some(list) = map.get_mut(k) {
                list.retain(|n| !Arc::ptr_eq(n, notify));
                if list.is_empty() {
                    map.remove(k);
                }
            }
        }
        self.count.store(map.len(), Ordering::Release);
    }

    /// Wakes the longest-waiting client blocked on `key`, if any. Clients are served in the
    /// order they blocked, as Redis serves them: the one woken tries first, and when it leaves
    /// (served, or answered otherwise) it wakes the next (see [`unregister_and_pass`]).
    ///
    /// [`unregister_and_pass`]: Self::unregister_and_pass
    #[inline]
    pub fn wake(&self, key: &[u8]) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        if let Some(first) = self.keys.lock().get(key).and_then(|list| list.first()) {
            first.notify_one();
        }
    }

    /// [`unregister`](Self::unregister), then wakes the next client in line on each key, which
    /// then sees what this one left (a push of several elements serves several clients).
    pub fn unregister_and_pass(&self, keys: &[Vec<u8>], notify: &Arc<Notify>) {
        self.unregister(keys, notify);
        for k in keys {
            self.wake(k);
        }
    }

    /// Whether `notify` is the longest-waiting client on any of `keys`.
    pub fn is_first(&self, keys: &[Vec<u8>], notify: &Arc<Notify>) -> bool {
        let map = self.keys.lock();
        keys.iter().any(|k| {
            map.get(k)
                .and_then(|list| list.first())
                .is_some_and(|n| Arc::ptr_eq(n, notify))
        })
    }

    /// Keys with blocked clients (INFO's `blocked_keys`).
    pub fn keys(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_wake_before_the_wait_is_kept_and_keys_are_forgotten_after() {
        let w = KeyWaiters::default();
        let n = Arc::new(Notify::new());
        let keys = vec![b"a".to_vec(), b"b".to_vec()];
        w.register(&keys, &n);
        assert_eq!(w.keys(), 2);
        w.wake(b"other");
        w.wake(b"b");
        tokio::time::timeout(std::time::Duration::from_secs(5), n.notified())
            .await
            .expect("the wake before the wait is kept");
        w.unregister(&keys, &n);
        assert_eq!(w.keys(), 0);
        w.wake(b"a");
    }

    #[tokio::test]
    async fn clients_are_woken_in_the_order_they_blocked() {
        let w = KeyWaiters::default();
        let (first, second) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let keys = vec![b"k".to_vec()];
        w.register(&keys, &first);
        w.register(&keys, &second);
        w.wake(b"k");
        let wait = std::time::Duration::from_millis(50);
        tokio::time::timeout(wait, first.notified())
            .await
            .expect("the first to block is woken");
        assert!(tokio::time::timeout(wait, second.notified()).await.is_err());
        w.unregister_and_pass(&keys, &first);
        tokio::time::timeout(wait, second.notified())
            .await
            .expect("the next in line is woken when the first leaves");
    }
}
