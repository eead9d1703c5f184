//! The background completion pool: the threads, at the lowest priority, that finish partly
//! tokenized prompts off the request path (`super::prompt::complete_later`), and how they give
//! way to route calls. Owned by `AppState` ([`Background`]), not a process global; knows nothing
//! of the state it serves.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Background completions ([`complete_later`]) queued or running at most at once; beyond, they are
/// skipped. Also the number of threads that run them.
pub const MAX_BACKGROUND_COMPLETIONS: usize = 2;

/// The nice value of the background completions' threads: the lowest priority, so a completion
/// (about one whole encode of a cold prompt, ~50 ms of CPU at 38k tokens) runs on CPU that route
/// calls leave idle instead of sharing a core with them. On the blocking pool, at the route's own
/// priority, two completions held both cores of a 2-core gateway and warm routes queued behind
/// them (the route benchmark's 64 concurrent callers: warm p99 no lower than cold).
pub const BACKGROUND_NICE: i32 = 19;

/// How long, in all, a background completion waits for route calls before it gives up: it
/// encodes only while no route call is in flight ([`give_way`]). Nice 19 (and `SCHED_IDLE`, tried)
/// did not keep it from slowing routes: in the route benchmark's 64 concurrent callers, warm routes'
/// p99 rose a median 1.82 × with cold callers beside them, 1.47 × with this wait (9 runs each).
pub const BACKGROUND_MAX_WAIT: Duration = Duration::from_secs(1);

/// How long a waiting completion sleeps before it looks at the route calls in flight again.
pub(super) const BACKGROUND_WAIT_STEP: Duration = Duration::from_micros(200);

type Completion = Box<dyn FnOnce() + Send>;

/// The background completion threads ([`MAX_BACKGROUND_COMPLETIONS`] of them, nice
/// [`BACKGROUND_NICE`]) and their queue, owned by [`AppState`]; the threads start on first use and
/// end when the pool is dropped (their queue closes).
#[derive(Default)]
pub struct Background {
    /// `None` when no thread could be started (completions are then skipped: the engine's events
    /// bring the same blocks a little later).
    queue: std::sync::OnceLock<Option<std::sync::mpsc::SyncSender<Completion>>>,
    in_flight: Arc<AtomicUsize>,
}

impl Background {
    /// Completions queued or running now (the route bench waits for none before a case that needs
    /// its own prompt completed, so an earlier case's cannot make it skip).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    fn queue(&self) -> Option<&std::sync::mpsc::SyncSender<Completion>> {
        self.queue.get_or_init(start_threads).as_ref()
    }

    /// Runs `job` on a background thread unless [`MAX_BACKGROUND_COMPLETIONS`] are already queued
    /// or running; `false` when it was skipped.
    pub(super) fn run(&self, job: impl FnOnce() + Send + 'static) -> bool {
        struct InFlight(Arc<AtomicUsize>);
        impl Drop for InFlight {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        if self.in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_BACKGROUND_COMPLETIONS {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        let in_flight = InFlight(self.in_flight.clone());
        let job: Completion = Box::new(move || {
            let _in_flight = in_flight;
            job();
        });
        // A full queue cannot happen while the counter holds (at most as many jobs as threads); a
        // failed send drops the job and its counter guard with it.
        self.queue().is_some_and(|q| q.try_send(job).is_ok())
    }
}

/// Starts the threads; the queue's sender, or `None` when no thread started.
fn start_threads() -> Option<std::sync::mpsc::SyncSender<Completion>> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Completion>(MAX_BACKGROUND_COMPLETIONS);
    let rx = Arc::new(std::sync::Mutex::new(rx));
    let mut started = 0;
    for i in 0..MAX_BACKGROUND_COMPLETIONS {
        let rx = rx.clone();
        let spawned = std::thread::Builder::new().name(format!("kvmesh-complete-{i}")).spawn(move || {
            // Per thread on Linux: only this thread's priority drops.
            if let Err(e) = rustix::process::setpriority_process(None, BACKGROUND_NICE) {
                tracing::warn!(error = %e, "background tokenization thread keeps its priority: setpriority failed");
            }
            loop {
                // One thread waits in recv while holding the lock; the others wait for the lock.
                let next = rx.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).recv();
                match next {
                    Ok(job) => job(),
                    Err(_) => return,
                }
            }
        });
        match spawned {
            Ok(_) => started += 1,
            Err(e) => tracing::warn!(error = %e, "cannot start a background tokenization thread"),
        }
    }
    (started > 0).then_some(tx)
}

/// Lets a background completion's next chunk wait while route calls are in flight (`inflight`):
/// sleeps `step` at a time, adding what it slept to `waited`; `false` once `waited` reaches `max`.
pub(super) fn give_way(
    inflight: &AtomicUsize,
    waited: &mut Duration,
    max: Duration,
    step: Duration,
) -> bool {
    while inflight.load(Ordering::Acquire) > 0 {
        if *waited >= max {
            return false;
        }
        let slept = Instant::now();
        std::thread::sleep(step);
        *waited += slept.elapsed();
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_background_completion_waits_while_routes_are_in_flight_and_gives_up_after_its_budget() {
        let step = Duration::from_micros(200);
        let max = Duration::from_millis(5);
        let inflight = Arc::new(AtomicUsize::new(0));
        let mut waited = Duration::ZERO;
        assert!(give_way(&inflight, &mut waited, max, step), "nothing in flight: go on");
        assert_eq!(waited, Duration::ZERO, "without sleeping");

        inflight.store(1, Ordering::Release);
        let release = {
            let inflight = inflight.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(2));
                inflight.store(0, Ordering::Release);
            })
        };
        assert!(
            give_way(&inflight, &mut waited, Duration::from_secs(30), step),
            "the route ended: go on"
        );
        assert!(waited >= Duration::from_millis(1), "it waited for the route ({waited:?})");
        release.join().expect("the releasing thread");

        inflight.store(1, Ordering::Release);
        let mut waited = Duration::ZERO;
        assert!(
            !give_way(&inflight, &mut waited, max, step),
            "routes in flight throughout: give up"
        );
        assert!(waited >= max, "after the whole budget ({waited:?})");
    }

    #[test]
    fn a_background_completion_runs_at_the_lowest_priority_off_the_callers_thread() {
        let callers = rustix::process::getpriority_process(None).expect("getpriority");
        let (tx, rx) = std::sync::mpsc::channel();
        // Other tests' route calls may hold both slots for a moment: retry until this job is queued.
        let pool = Background::default();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let tx = tx.clone();
            let queued = pool.run(move || {
                let _ = tx.send((
                    std::thread::current().name().map(str::to_owned),
                    rustix::process::getpriority_process(None),
                ));
            });
            if queued {
                break;
            }
            assert!(Instant::now() < deadline, "no background slot came free in 30 s");
            std::thread::sleep(Duration::from_millis(10));
        }
        let (thread, nice) = rx.recv_timeout(Duration::from_secs(30)).expect("the completion ran");
        assert!(
            thread.is_some_and(|n| n.starts_with("kvmesh-complete-")),
            "ran on a background thread"
        );
        assert_eq!(nice.expect("getpriority"), BACKGROUND_NICE);
        assert_eq!(
            rustix::process::getpriority_process(None).expect("getpriority"),
            callers,
            "only the background thread's priority dropped"
        );
    }
}
