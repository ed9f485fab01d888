//! `GradientState` and its guards used from several threads at once, as documented: one
//! shared state per handle, each `accumulate` guard gets its own decision, exactly one in
//! `num_steps` batches syncs, and data-loader registration is visible everywhere.

use std::sync::{Arc, Barrier};
use std::thread;

use burn_accelerate::GradientState;

const THREADS: usize = 4;
const PER_THREAD: usize = 30;

#[test]
fn concurrent_accumulate_guards_each_get_their_own_decision() {
    let state = GradientState::new();
    state.configure(3, false).unwrap();
    let start = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let (state, start) = (state.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                (0..PER_THREAD)
                    .map(|_| {
                        let guard = state.accumulate();
                        (guard.sync_gradients(), guard.window_batches())
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let decisions: Vec<(bool, usize)> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    let syncs = decisions.iter().filter(|(sync, _)| *sync).count();
    assert_eq!(syncs, THREADS * PER_THREAD / 3, "one batch in three syncs");
    // Every sync closes a full window of three.
    assert!(decisions.iter().all(|&(sync, w)| !sync || w == 3));
    assert_eq!(state.step(), THREADS * PER_THREAD);
    assert_eq!(state.open_accumulates(), 0, "every guard was dropped");
}

#[test]
fn guards_can_move_between_threads() {
    let state = GradientState::new();
    let guard = state.accumulate();
    let loader = state.begin_dataloader();
    assert_eq!(state.open_accumulates(), 1);
    thread::spawn(move || {
        loader.set_end_of_dataloader(Some(2));
        drop(guard);
        // The loader guard is kept alive here until this thread ends.
        assert!(loader.gradient_state().end_of_dataloader());
    })
    .join()
    .unwrap();
    assert_eq!(state.open_accumulates(), 0);
    assert!(!state.in_dataloader(), "the loader ended with its thread");
}

#[test]
fn a_loader_on_one_thread_decides_the_sync_of_a_step_on_another() {
    let state = GradientState::new();
    state.configure(4, true).unwrap();
    let loader = state.begin_dataloader();
    let worker = state.clone();
    let first = thread::spawn(move || worker.accumulate().sync_gradients())
        .join()
        .unwrap();
    assert!(!first);
    loader.set_end_of_dataloader(Some(1));
    assert_eq!(state.remainder(), Some(1));
    let worker = state.clone();
    let last = thread::spawn(move || worker.accumulate().sync_gradients())
        .join()
        .unwrap();
    assert!(last, "the loader's last batch syncs, seen from the worker");
    assert_eq!(state.step(), 0);
}

#[test]
fn the_global_state_is_shared_by_every_thread() {
    let here = GradientState::global();
    let there = thread::spawn(GradientState::global).join().unwrap();
    assert!(here.same_as(&there));
}
