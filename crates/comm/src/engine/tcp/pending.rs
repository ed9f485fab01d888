//! A listener's connections that have not yet proved they know the run's secret: at most
//! [`MAX_PENDING`] at once per listener, so that a flood of silent connections costs the
//! process a bounded amount (each pending one is a task, its socket and a timer, about
//! 1.4 KiB), whatever their number.
//!
//! Past the cap the *oldest* pending connection is dropped, not the new one. A real peer's
//! handshake takes one round trip; a silent stranger's lasts until its timeout
//! ([`HANDSHAKE_WITHIN`](super::auth::HANDSHAKE_WITHIN)). Dropping the oldest, a real peer
//! arriving during a flood is the newest and finishes its handshake long before `MAX_PENDING`
//! newer connections push it out; refusing new ones instead, a flood that keeps the cap full
//! (opening a connection for each one that times out) would refuse every real peer for as
//! long as it lasts. A dropped connection is told so ([`auth::BUSY`](super::auth::BUSY), in
//! place of the proof) and its dialer tries again within its own timeout, so even a real peer
//! pushed out by a faster flood is only delayed.
//!
//! The cap bounds the connections that are *alive*, not only those in the table: a pushed-out
//! connection holds its place until its task has ended, and the listener accepts no new
//! connection while every place is held. Otherwise a burst accepted faster than the pushed-out
//! tasks run (a thousand connections in a few milliseconds, on a busy machine) holds every
//! one of them at once, cap or no cap; the kernel's accept queue holds the rest meanwhile.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};

/// Connections of one listener that may be in their handshake at once. A run's own
/// connections arrive at most a few per peer at a time (every process at the rendezvous at
/// once, in a run of hundreds, is the largest burst): one pushed out tries again.
pub(crate) const MAX_PENDING: usize = 128;

/// The handshakes in progress at one listener.
pub(crate) struct Pending {
    cap: usize,
    state: Mutex<State>,
    /// One per connection alive, pushed out or not: `cap` in all.
    places: Arc<Semaphore>,
}

#[derive(Default)]
struct State {
    next: u64,
    /// By arrival: dropping a sender tells its connection it was pushed out.
    waiting: BTreeMap<u64, oneshot::Sender<()>>,
}

/// One connection's place among its listener's pending handshakes, given up when dropped.
pub(crate) struct Ticket {
    pending: Arc<Pending>,
    id: u64,
    pushed_out: oneshot::Receiver<()>,
    // Dropped after `Drop::drop` has left the table, so that a free place never finds the
    // table full.
    _place: OwnedSemaphorePermit,
}

impl Pending {
    /// No handshake in progress; at most `cap` at once.
    pub(crate) fn new(cap: usize) -> Arc<Self> {
        let cap = cap.max(1);
        Arc::new(Self {
            cap,
            state: Mutex::default(),
            places: Arc::new(Semaphore::new(cap)),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place for a new connection. When every place is held, the oldest connection in its
    /// handshake is pushed out, and this waits until its task has ended and given its place
    /// back (or, if one pushed out earlier is still ending, until that one has).
    pub(crate) async fn admit(self: &Arc<Self>) -> Ticket {
        let place = match Arc::clone(&self.places).try_acquire_owned() {
            Ok(place) => place,
            Err(_) => {
                {
                    let mut state = self.lock();
                    // Every place held and every holder in the table: none is already leaving.
                    if state.waiting.len() == self.cap {
                        // Its sender dropped: the oldest connection's `handshake` ends with
                        // `None`.
                        state.waiting.pop_first();
                    }
                }
                Arc::clone(&self.places)
                    .acquire_owned()
                    .await
                    .expect("the places are never closed")
            }
        };
        let (sender, pushed_out) = oneshot::channel();
        let mut state = self.lock();
        let id = state.next;
        state.next += 1;
        state.waiting.insert(id, sender);
        drop(state);
        Ticket {
            pending: Arc::clone(self),
            id,
            pushed_out,
            _place: place,
        }
    }

    /// How many connections are in their handshake now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().waiting.len()
    }
}

impl Ticket {
    /// Runs `handshake` (which keeps its own timeout) to its end, or `None` once newer
    /// connections push this one out.
    pub(crate) async fn handshake<F: Future>(mut self, handshake: F) -> Option<F::Output> {
        tokio::select! {
            // A handshake that ended wins over a push that came at the same time: it is no
            // longer pending, and its peer is not made to start again.
            biased;
            outcome = handshake => Some(outcome),
            _ = &mut self.pushed_out => None,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.pending.lock().waiting.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn block_on<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn past_the_cap_the_oldest_handshake_is_pushed_out_and_the_newest_ends() {
        block_on(async {
            let pending = Pending::new(3);
            let mut silent = Vec::new();
            for _ in 0..5 {
                let ticket = pending.admit().await;
                silent.push(tokio::spawn(ticket.handshake(std::future::pending::<()>())));
                tokio::task::yield_now().await;
                assert!(pending.len() <= 3);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            // The two oldest were pushed out; the three newest still wait.
            for (i, task) in silent.iter().enumerate() {
                assert_eq!(task.is_finished(), i < 2, "connection {i}");
            }
            // A real peer arriving now answers at once, and the oldest silent one goes.
            let real = pending.admit().await;
            let done = real.handshake(async { "proved" }).await;
            assert_eq!(done, Some("proved"));
            tokio::time::sleep(Duration::from_millis(10)).await;
            assert!(silent[2].is_finished());
            // A finished handshake gives its place back.
            assert_eq!(pending.len(), 2);
            for task in silent.drain(..) {
                task.abort();
                let _ = task.await;
            }
            assert_eq!(pending.len(), 0);
        });
    }

    // The accept loop takes connections as fast as the kernel hands them over and never
    // yields to their tasks between two, as a listener under a burst does.
    #[test]
    fn a_burst_faster_than_its_tasks_never_keeps_more_than_the_cap_alive() {
        block_on(async {
            let pending = Pending::new(4);
            let mut tasks = Vec::new();
            for i in 0..50 {
                let ticket = pending.admit().await;
                let alive = tasks
                    .iter()
                    .filter(|task: &&tokio::task::JoinHandle<_>| !task.is_finished())
                    .count();
                assert!(alive < 4, "connection {i}: {alive} others alive");
                tasks.push(tokio::spawn(ticket.handshake(std::future::pending::<()>())));
            }
            assert_eq!(pending.len(), 4);
            for task in tasks.drain(..) {
                task.abort();
                let _ = task.await;
            }
            assert_eq!(pending.len(), 0);
        });
    }
}
