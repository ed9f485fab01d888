//! Accelerate's `wait_for_everyone`, `main_process_first` and `local_main_process_first`:
//! barriers of the run's process group, the last two as guards that hold some processes back
//! while the others run a block.

use super::error::DistributedError;
use super::process_state::ProcessState;

impl ProcessState {
    /// Waits until every process reaches this point (Accelerate's `wait_for_everyone`).
    /// Returns at once for a single process.
    ///
    /// # Errors
    /// A [`DistributedError`] when the group cannot be joined, a process left, or the wait
    /// timed out.
    pub fn wait_for_everyone(&self) -> Result<(), DistributedError> {
        if !self.is_distributed() {
            return Ok(());
        }
        self.group()?.barrier()
    }

    /// Lets the main process run a block first (downloading, preprocessing), then the
    /// others: Accelerate's `with state.main_process_first():`. The other processes wait in
    /// this call until the main process's guard is dropped (or
    /// [released](FirstGuard::release)).
    ///
    /// ```
    /// # use burn_accelerate::distributed::ProcessState;
    /// let state = ProcessState::single();
    /// {
    ///     let _first = state.main_process_first()?;
    ///     // prepare the dataset cache: the main process does it, the others find it done
    /// }
    /// # Ok::<(), burn_accelerate::distributed::DistributedError>(())
    /// ```
    ///
    /// # Errors
    /// As [`wait_for_everyone`](Self::wait_for_everyone), for the processes that wait.
    pub fn main_process_first(&self) -> Result<FirstGuard, DistributedError> {
        FirstGuard::enter(self, self.is_main_process())
    }

    /// As [`main_process_first`](Self::main_process_first), with each machine's local main
    /// process first (Accelerate's `local_main_process_first`).
    ///
    /// # Errors
    /// As [`wait_for_everyone`](Self::wait_for_everyone).
    pub fn local_main_process_first(&self) -> Result<FirstGuard, DistributedError> {
        FirstGuard::enter(self, self.is_local_main_process())
    }
}

/// The guard of [`ProcessState::main_process_first`]: the processes that go first wait for
/// the others when it drops. Dropped by a panic instead, it fails the waiting processes'
/// collectives (a [`DistributedError::Aborted`] naming this process) rather than release them
/// onto half-done work.
#[must_use = "the processes that go first run their block while the guard lives"]
#[derive(Debug)]
pub struct FirstGuard {
    state: ProcessState,
    first: bool,
    done: bool,
}

impl FirstGuard {
    fn enter(state: &ProcessState, first: bool) -> Result<Self, DistributedError> {
        if !first {
            state.wait_for_everyone()?;
        }
        Ok(Self {
            state: state.clone(),
            first,
            done: false,
        })
    }

    /// Ends the block now and reports whether the wait succeeded (dropping the guard logs a
    /// failure instead; the next collective then fails too).
    ///
    /// # Errors
    /// As [`ProcessState::wait_for_everyone`].
    pub fn release(mut self) -> Result<(), DistributedError> {
        self.done = true;
        if self.first {
            self.state.wait_for_everyone()?;
        }
        Ok(())
    }
}

impl Drop for FirstGuard {
    fn drop(&mut self) {
        if !self.first || self.done {
            return;
        }
        // A panic in the block: the processes waiting for it must not go on with its work half
        // done, so they fail instead of being released.
        if std::thread::panicking() {
            if let Ok(group) = self.state.group() {
                group.abort(format!(
                    "process {} panicked inside main_process_first / local_main_process_first: \
                     the processes waiting for its work stop instead of going on without it",
                    self.state.process_index()
                ));
            }
            return;
        }
        if let Err(err) = self.state.wait_for_everyone() {
            log::error!("burn-accelerate: {err}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_process_waits_for_nobody() {
        let s = ProcessState::single();
        s.wait_for_everyone().unwrap();
        s.main_process_first().unwrap().release().unwrap();
        drop(s.local_main_process_first().unwrap());
    }
}
