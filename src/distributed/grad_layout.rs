//! Which order a gradient's values travel in, agreed by every process before any value is
//! summed: pure functions over what each process says of its gradients.
//!
//! A backend that lends its storage (Flex) lets the sync reduce a gradient as it lies in
//! memory, in whatever order its strides put the values (a transposed view's, column by
//! column), and give it back with the same layout: no transpose, no fresh pages. That is only
//! sound where every process's values lie in the same order, or the sum would add one
//! process's value at `[i, j]` to another's at `[j, i]`. So each process describes each
//! gradient ([`record`]: absent, present in logical order only, or present and dense with
//! these strides), the descriptions are gathered in one small collective, and every process
//! derives the same [`Route`] for each gradient from all of them ([`agree`]): as stored where
//! every process that has the gradient has it dense with the same strides (and, on three
//! processes or more, those strides keep the logical order, so that the ring sums every value
//! as the contiguous path does, bit for bit), in logical (row-major) order otherwise. A
//! process without the gradient contributes zeros in the agreed order.

/// How one parameter's gradient travels, the same on every process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Route {
    /// No process has a gradient for it: it stays without one (an optimizer would otherwise
    /// move it with a zero gradient, through its momentum).
    Absent,
    /// Its storage as it lies: every process that has it has it dense with these strides.
    AsStored(Vec<isize>),
    /// In logical (row-major) order: the processes' layouts differ, or one is not dense.
    Logical,
}

/// A gradient's route and how many processes have it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Agreed {
    /// How it travels.
    pub(crate) route: Route,
    /// How many processes have it (0 with [`Route::Absent`] only).
    pub(crate) present: u32,
}

// The first word of a gradient's record.
const ABSENT: u64 = 0;
const LOGICAL: u64 = 1;
const DENSE: u64 = 2;

/// What a process has of one gradient of `rank` dimensions, as [`record`] gets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Held<'a> {
    /// No gradient here.
    Absent,
    /// A gradient that can only travel in logical order (not dense, or not in f32).
    Logical,
    /// A dense f32 gradient with these strides (in values), [`is_dense`] for its shape.
    Dense(&'a [isize]),
}

/// The words that describe one gradient of `rank` dimensions: a kind, then `rank` strides
/// (zeros unless dense). Every process's record of a model has the same length.
pub(crate) fn record(held: Held<'_>, rank: usize, into: &mut Vec<u64>) {
    match held {
        Held::Absent => into.push(ABSENT),
        Held::Logical => into.push(LOGICAL),
        Held::Dense(strides) => {
            debug_assert_eq!(strides.len(), rank);
            into.push(DENSE);
            into.extend(strides.iter().map(|&s| s as i64 as u64));
            return;
        }
    }
    into.extend(std::iter::repeat_n(0, rank));
}

/// The length of a process's record of gradients of these ranks.
pub(crate) fn record_len(ranks: &[usize]) -> usize {
    ranks.iter().map(|r| 1 + r).sum()
}

/// Every gradient's route, from every process's record (`gathered`: the processes' records
/// of gradients of `ranks` dimensions, in rank order). The same on every process, since every
/// process derives it from the same words.
///
/// # Errors
/// The process whose record is not one [`record`] writes, and what is wrong with it.
pub(crate) fn agree(
    ranks: &[usize],
    gathered: &[u64],
    processes: usize,
) -> Result<Vec<Agreed>, (usize, String)> {
    let len = record_len(ranks);
    if gathered.len() != len * processes {
        return Err((
            0,
            format!(
                "{} words of gradient layouts for {processes} processes of {len} each",
                gathered.len()
            ),
        ));
    }
    let records: Vec<&[u64]> = gathered.chunks(len.max(1)).take(processes).collect();
    let mut agreed = Vec::with_capacity(ranks.len());
    let mut at = 0;
    for &rank in ranks {
        let mut present = 0u32;
        let mut route: Option<Route> = None;
        for (process, words) in records.iter().enumerate() {
            let words = &words[at..at + 1 + rank];
            let strides = || words[1..].iter().map(|&w| w as i64 as isize).collect();
            let here = match words[0] {
                ABSENT => continue,
                LOGICAL => Route::Logical,
                DENSE => Route::AsStored(strides()),
                kind => {
                    return Err((process, format!("gradient layout kind {kind} is unknown")));
                }
            };
            present += 1;
            route = Some(match route {
                None => here,
                Some(before) if before == here => before,
                // Another layout, or one in logical order only: the values would not line up.
                Some(_) => Route::Logical,
            });
        }
        let route = match route {
            // On three processes or more the ring adds a value's contributions in an order
            // that depends on the block of the buffer it falls in: values lying in another
            // order than the logical one would fall in other blocks than on the contiguous
            // path and end a rounding apart. Two processes add the same two values either way.
            Some(Route::AsStored(strides)) if processes > 2 && !in_logical_order(&strides) => {
                Route::Logical
            }
            route => route.unwrap_or(Route::Absent),
        };
        agreed.push(Agreed { route, present });
        at += 1 + rank;
    }
    Ok(agreed)
}

/// Whether a dense layout's strides put its values in logical (row-major) order: they do not
/// increase from one dimension to the next. (A dimension of length 1 with an odd stride makes
/// this say no, which only costs a copy.)
pub(crate) fn in_logical_order(strides: &[isize]) -> bool {
    strides.windows(2).all(|w| w[0] >= w[1])
}

/// Whether a tensor of `dims` with `strides` covers exactly as many consecutive values of its
/// storage, from its start offset, as it has values: every stride of a dimension longer than
/// 1 positive, and those strides, in increasing order, a contiguous tensor's for its
/// dimensions so ordered (any permutation of a contiguous tensor, a transposed view
/// included). A dimension of length 1 may have any stride; an empty tensor is dense.
pub(crate) fn is_dense(dims: &[usize], strides: &[isize]) -> bool {
    if dims.len() != strides.len() {
        return false;
    }
    if dims.contains(&0) {
        return true;
    }
    let mut axes: Vec<(isize, usize)> = dims
        .iter()
        .zip(strides)
        .filter(|(d, _)| **d > 1)
        .map(|(d, s)| (*s, *d))
        .collect();
    axes.sort_unstable();
    let mut expected: isize = 1;
    for (stride, dim) in axes {
        if stride != expected {
            return false;
        }
        let Some(next) = isize::try_from(dim)
            .ok()
            .and_then(|d| expected.checked_mul(d))
        else {
            return false;
        };
        expected = next;
    }
    true
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn gathered(records: &[Vec<Held<'_>>], ranks: &[usize]) -> Vec<u64> {
        let mut words = Vec::new();
        for process in records {
            for (held, rank) in process.iter().zip(ranks) {
                record(*held, *rank, &mut words);
            }
        }
        words
    }

    #[test]
    fn permutations_of_contiguous_tensors_are_dense_and_nothing_else_is() {
        // Contiguous, transposed, a 3-D permutation.
        assert!(is_dense(&[3, 4], &[4, 1]));
        assert!(is_dense(&[3, 4], &[1, 3]));
        assert!(is_dense(&[2, 3, 4], &[1, 8, 2]));
        // Dimensions of length 1 may have any stride; empty tensors are dense.
        assert!(is_dense(&[3, 1, 4], &[4, 99, 1]));
        assert!(is_dense(&[1], &[-7]));
        assert!(is_dense(&[0, 5], &[5, 1]));
        assert!(is_dense(&[], &[]));
        // Gaps (a narrowed view), broadcasts, flips, overlaps, ranks that differ.
        assert!(!is_dense(&[3, 4], &[8, 1]));
        assert!(!is_dense(&[3, 4], &[0, 1]));
        assert!(!is_dense(&[3, 4], &[4, -1]));
        assert!(!is_dense(&[3, 4], &[1, 1]));
        assert!(!is_dense(&[3, 4], &[4]));
    }

    #[test]
    fn every_process_s_gradient_in_the_same_layout_travels_as_stored() {
        let (t, c) = ([1isize, 3], [4isize, 1]);
        let ranks = [2, 1, 2, 2];
        let words = gathered(
            &[
                vec![
                    Held::Dense(&c),
                    Held::Dense(&[1]),
                    Held::Dense(&t),
                    Held::Absent,
                ],
                vec![Held::Dense(&c), Held::Absent, Held::Dense(&c), Held::Absent],
                vec![
                    Held::Dense(&c),
                    Held::Logical,
                    Held::Dense(&t),
                    Held::Absent,
                ],
            ],
            &ranks,
        );
        let agreed = agree(&ranks, &words, 3).unwrap();
        let routes: Vec<(Route, u32)> = agreed.into_iter().map(|a| (a.route, a.present)).collect();
        assert_eq!(
            routes,
            [
                (Route::AsStored(c.to_vec()), 3),
                // Dense on one process, logical on another: logical everywhere.
                (Route::Logical, 2),
                // Transposed on two processes, contiguous on one: never summed as stored.
                (Route::Logical, 3),
                (Route::Absent, 0),
            ]
        );
    }

    #[test]
    fn a_transposed_layout_travels_as_stored_on_two_processes_only() {
        let t = [1isize, 3];
        let two = gathered(&[vec![Held::Dense(&t)], vec![Held::Dense(&t)]], &[2]);
        assert_eq!(
            agree(&[2], &two, 2).unwrap()[0].route,
            Route::AsStored(t.to_vec())
        );
        // Three: its values would fall in other blocks of the ring than in logical order.
        let three = gathered(
            &[
                vec![Held::Dense(&t)],
                vec![Held::Dense(&t)],
                vec![Held::Dense(&t)],
            ],
            &[2],
        );
        assert_eq!(agree(&[2], &three, 3).unwrap()[0].route, Route::Logical);
        assert!(in_logical_order(&[4, 1]) && in_logical_order(&[12, 4, 1]));
        assert!(!in_logical_order(&[1, 3]) && !in_logical_order(&[4, 1, 2]));
    }

    #[test]
    fn a_gradient_some_processes_lack_keeps_the_others_layout() {
        let t = [1isize, 3];
        let words = gathered(&[vec![Held::Absent], vec![Held::Dense(&t)]], &[2]);
        let agreed = agree(&[2], &words, 2).unwrap();
        assert_eq!(agreed[0].route, Route::AsStored(t.to_vec()));
        assert_eq!(agreed[0].present, 1);
    }

    #[test]
    fn records_that_do_not_fit_are_refused_with_the_process() {
        let mut words = gathered(&[vec![Held::Absent], vec![Held::Absent]], &[2]);
        assert_eq!(agree(&[2], &words, 2).unwrap()[0].route, Route::Absent);
        words[3] = 7;
        let (process, detail) = agree(&[2], &words, 2).unwrap_err();
        assert_eq!(process, 1);
        assert!(detail.contains("kind 7"), "{detail}");
        assert!(agree(&[2], &words[1..], 2).is_err());
    }

    proptest! {
        // Negative strides survive the words.
        #[test]
        fn strides_round_trip(strides in proptest::collection::vec(-1000isize..1000, 0..5)) {
            let mut words = Vec::new();
            record(Held::Dense(&strides), strides.len(), &mut words);
            prop_assert_eq!(words.len(), record_len(&[strides.len()]));
            let agreed = agree(&[strides.len()], &words, 1).unwrap();
            prop_assert_eq!(&agreed[0].route, &Route::AsStored(strides.clone()));
        }

        // A dense layout's values are exactly the span from its start offset, once each.
        #[test]
        fn a_dense_layout_covers_its_span_once(
            dims in proptest::collection::vec(1usize..5, 0..4),
            seed in any::<u64>(),
        ) {
            // A contiguous layout of `dims` permuted by a seeded shuffle.
            let mut order: Vec<usize> = (0..dims.len()).collect();
            let mut s = seed;
            for i in (1..order.len()).rev() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                order.swap(i, (s >> 33) as usize % (i + 1));
            }
            let mut strides = vec![0isize; dims.len()];
            let mut next = 1isize;
            for &axis in order.iter().rev() {
                strides[axis] = next;
                next *= dims[axis] as isize;
            }
            prop_assert!(is_dense(&dims, &strides));
            let numel: usize = dims.iter().product();
            let mut seen = vec![false; numel];
            for flat in 0..numel {
                let (mut rest, mut at) = (flat, 0isize);
                for axis in (0..dims.len()).rev() {
                    at += (rest % dims[axis]) as isize * strides[axis];
                    rest /= dims[axis];
                }
                prop_assert!(!seen[at as usize]);
                seen[at as usize] = true;
            }
        }
    }
}
