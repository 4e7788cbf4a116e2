//! The writer's I/O threads: a fixed set of threads that run block writes taken from one queue.
//! The writer issues a flush's writes and goes on to the next flush without waiting for them, so
//! the disk keeps requests in flight across flush boundaries instead of draining its queue at the
//! end of every flush (`engine::WriteLatch` tells the finisher when a flush's writes are done).
//! The threads live as long as the writer: starting threads for every flush cost their creation
//! and, worse, left the disk idle meanwhile.

use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;

type Task = Box<dyn FnOnce() + Send + 'static>;

struct Queue {
    tasks: VecDeque<Task>,
    closed: bool,
}

struct Inner {
    queue: Mutex<Queue>,
    ready: Condvar,
}

/// Threads that run submitted tasks in submission order (each task on whichever thread is free).
/// Dropping the pool lets the threads finish every task already submitted, then joins them.
pub struct IoPool {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

impl IoPool {
    /// Starts `threads` threads named `name`. If none can be started, tasks run on the caller's
    /// thread when submitted.
    pub fn new(threads: usize, name: &str) -> IoPool {
        let inner = Arc::new(Inner {
            queue: Mutex::new(Queue {
                tasks: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
        });
        let mut handles = Vec::with_capacity(threads);
        for _ in 0..threads {
            let inner = inner.clone();
            match std::thread::Builder::new()
                .name(name.into())
                .spawn(move || worker(&inner))
            {
                Ok(h) => handles.push(h),
                Err(e) => {
                    tracing::warn!("could not start an I/O thread ({e}); running with fewer");
                    break;
                }
            }
        }
        IoPool {
            inner,
            threads: handles,
        }
    }

    /// Runs `task` on a pool thread (or now, on this thread, if the pool has none).
    pub fn submit(&self, task: impl FnOnce() + Send + 'static) {
        if self.threads.is_empty() {
            task();
            return;
        }
        self.inner.queue.lock().tasks.push_back(Box::new(task));
        self.inner.ready.notify_one();
    }

    /// Threads running tasks.
    #[cfg(test)]
    pub fn threads(&self) -> usize {
        self.threads.len()
    }
}

fn worker(inner: &Inner) {
    loop {
        let task = {
            let mut q = inner.queue.lock();
            loop {
                if let Some(t) = q.tasks.pop_front() {
                    break t;
                }
                if q.closed {
                    return;
                }
                inner.ready.wait(&mut q);
            }
        };
        task();
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        self.inner.queue.lock().closed = true;
        self.inner.ready.notify_all();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_submitted_task_runs_once() {
        let pool = IoPool::new(4, "test-io");
        assert_eq!(pool.threads(), 4);
        let ran: Arc<Vec<AtomicUsize>> = Arc::new((0..1000).map(|_| AtomicUsize::new(0)).collect());
        let (tx, rx) = std::sync::mpsc::channel();
        for i in 0..1000 {
            let (ran, tx) = (ran.clone(), tx.clone());
            pool.submit(move || {
                ran[i].fetch_add(1, Ordering::SeqCst);
                let _ = tx.send(i);
            });
        }
        drop(tx);
        let mut seen: Vec<usize> = rx.iter().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..1000).collect::<Vec<_>>());
        assert!(ran.iter().all(|r| r.load(Ordering::SeqCst) == 1));
    }

    #[test]
    fn dropping_the_pool_finishes_what_was_submitted() {
        let ran = Arc::new(AtomicUsize::new(0));
        {
            let pool = IoPool::new(2, "test-io");
            for _ in 0..200 {
                let ran = ran.clone();
                pool.submit(move || {
                    std::thread::sleep(std::time::Duration::from_micros(50));
                    ran.fetch_add(1, Ordering::SeqCst);
                });
            }
        }
        assert_eq!(ran.load(Ordering::SeqCst), 200);
    }

    #[test]
    fn a_pool_without_threads_runs_tasks_at_once() {
        let pool = IoPool::new(0, "test-io");
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        pool.submit(move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }
}
