//! The threads that run the native protocol's scans (SCAN_FILTERED, SCAN_TABLET, SCAN_NEXT pages):
//! a fixed pool whose threads run at the lowest CPU priority (`SCHED_IDLE`, and nice
//! [`SCAN_NICE`]), so that an analytic scan takes the cores the foreground leaves and gives them
//! back the moment requests come (TellStore's split of analytic from transactional work). The threads
//! a scan starts for its passes inherit that priority. Scans wait in the pool's queue when all
//! [`SCAN_THREADS`] are busy; each connection still bounds its own running jobs.

use parking_lot::Mutex;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, OnceLock};

/// Threads of the pool (scans running at once, over every connection).
pub const SCAN_THREADS: usize = 8;
/// The pool threads' nice value (0 is the request path's; 19 the lowest priority). At 10 a scan
/// thread weighs about a tenth of a request thread when both want a core.
pub const SCAN_NICE: i32 = 19;

type Task = Box<dyn FnOnce() + Send>;

struct Pool {
    tx: Mutex<Sender<Task>>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let (tx, rx) = channel::<Task>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..SCAN_THREADS {
            let rx = rx.clone();
            if let Err(e) = std::thread::Builder::new()
                .name(format!("scan-{i}"))
                .spawn(move || worker(&rx))
            {
                tracing::error!(error = %e, "cannot start a scan thread");
            }
        }
        Pool { tx: Mutex::new(tx) }
    })
}

fn worker(rx: &Mutex<Receiver<Task>>) {
    lower_priority();
    loop {
        let task = rx.lock().recv();
        match task {
            Ok(task) => task(),
            Err(_) => return,
        }
    }
}

/// Puts this thread in the `SCHED_IDLE` class (it runs only on a core no other thread wants, and
/// a request's thread that wakes preempts it at once), with nice [`SCAN_NICE`] as well should
/// the class be refused (Linux: both per thread).
fn lower_priority() {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: changes only this thread's scheduling class; `param` outlives the call.
    let idle = unsafe { libc::sched_setscheduler(tid, libc::SCHED_IDLE, &param) };
    // SAFETY: changes only this thread's nice value.
    let niced = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, SCAN_NICE) };
    if idle != 0 && niced != 0 {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "cannot lower a scan thread's priority; scans compete with requests as equals"
        );
    }
}

/// Runs `f` on a scan thread; its result, or None if it panicked.
pub async fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task: Task = Box::new(move || {
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).ok();
        let _ = tx.send(out);
    });
    if pool().tx.lock().send(task).is_err() {
        return None;
    }
    rx.await.ok().flatten()
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn runs_on_a_lower_priority_thread_and_survives_a_panic() {
        let seen = super::run(|| {
            // SAFETY: reads this thread's scheduling class and nice value.
            unsafe {
                let tid = libc::gettid();
                (
                    libc::sched_getscheduler(tid),
                    libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t),
                )
            }
        })
        .await;
        assert_eq!(seen, Some((libc::SCHED_IDLE, super::SCAN_NICE)));
        assert_eq!(
            super::run(|| -> u8 { panic!("a failing scan") }).await,
            None
        );
        assert_eq!(super::run(|| 7).await, Some(7));
    }
}
