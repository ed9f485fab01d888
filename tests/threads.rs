//! `threads::use_current_thread`: the calling thread becomes the first of rayon's global pool,
//! a bf16 training step computed on it gives the bits it gives on a thread outside the pool,
//! and the calls it refuses say why.
//!
//! Rayon's global pool is built once per process, so everything is one test (this file is
//! its own test binary).
#![cfg(feature = "flex")]

use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::relu;
use burn::tensor::module::{conv2d, linear};
use burn::tensor::ops::ConvOptions;
use burn::tensor::{Tensor, TensorData};
use burn_accelerate::{AccelerateError, Accelerated, Precision, autocast, threads};

#[cfg(target_os = "linux")]
mod cpu_mask;

type B = Accelerated<Autodiff<Flex>>;

fn data(shape: &[usize], seed: f32) -> TensorData {
    let len = shape.iter().product::<usize>();
    let values = (0..len)
        .map(|i| ((i as f32 + 1.0) * (seed + 0.37)).sin())
        .collect::<Vec<f32>>();
    TensorData::new(values, shape.to_vec())
}

// The bits of the gradients of a bf16 conv → ReLU → spatial mean → linear step: 16 images
// of 16 × 16, large enough for the convolution's and the GEMMs' parallel loops.
fn step_gradients() -> Vec<Vec<u32>> {
    let device = Default::default();
    let x = Tensor::<B, 4>::from_data(data(&[16, 3, 16, 16], 1.0), &device);
    let w = Tensor::<B, 4>::from_data(data(&[32, 3, 3, 3], 2.0), &device).require_grad();
    let b = Tensor::<B, 1>::from_data(data(&[32], 3.0), &device).require_grad();
    let head = Tensor::<B, 2>::from_data(data(&[32, 10], 4.0), &device).require_grad();
    let grads = {
        let _bf16 = autocast::enable(Precision::Bf16);
        let options = ConvOptions::new([1, 1], [1, 1], [1, 1], 1);
        let features = relu(conv2d(x, w.clone(), Some(b.clone()), options));
        let pooled = features.flatten::<3>(2, 3).mean_dim(2).squeeze_dim::<2>(2);
        linear(pooled, head.clone(), None)
            .powi_scalar(2)
            .mean()
            .backward()
    };
    [
        w.grad(&grads).map(|g| g.into_data()),
        b.grad(&grads).map(|g| g.into_data()),
    ]
    .into_iter()
    .chain([head.grad(&grads).map(|g| g.into_data())])
    .map(|grad| {
        let values = grad.expect("a gradient").convert::<f32>().to_vec::<f32>();
        values
            .expect("f32 values")
            .iter()
            .map(|v| v.to_bits())
            .collect()
    })
    .collect()
}

#[test]
fn the_calling_thread_computes_in_the_pool_with_the_same_bits() {
    let refused = threads::use_current_thread(Some(0)).unwrap_err();
    assert!(
        matches!(
            refused,
            AccelerateError::InvalidConfig {
                field: "threads",
                ..
            }
        ),
        "{refused}"
    );
    assert_eq!(rayon::current_thread_index(), None, "not in the pool yet");

    threads::use_current_thread(Some(2)).expect("the first call builds the pool");
    assert_eq!(rayon::current_thread_index(), Some(0));
    assert_eq!(rayon::current_num_threads(), 2);

    let in_pool = step_gradients();
    let outside = std::thread::spawn(|| {
        assert_eq!(rayon::current_thread_index(), None);
        step_gradients()
    })
    .join()
    .expect("the step outside the pool");
    assert_eq!(in_pool.len(), 3);
    assert!(
        in_pool
            .iter()
            .all(|grad| grad.iter().any(|bits| *bits != 0))
    );
    assert_eq!(in_pool, outside, "the same bits on either thread");

    let again = threads::use_current_thread(None).unwrap_err();
    let AccelerateError::ThreadPool { .. } = &again else {
        panic!("a second call is refused as ThreadPool, not {again:?}");
    };
    let message = again.to_string();
    assert!(
        message.contains("use_current_thread") && message.contains("before any op runs"),
        "{message}"
    );

    // Pinning once the pool exists: refused, and the calling thread, pinned for the attempt,
    // runs where it ran before.
    #[cfg(target_os = "linux")]
    {
        let before = cpu_mask::thread_mask();
        let pinned = threads::StepThreadsConfig::new()
            .with_threads(Some(1))
            .with_pin(true)
            .install()
            .unwrap_err();
        assert!(
            matches!(pinned, AccelerateError::ThreadPool { .. }),
            "{pinned}"
        );
        assert_eq!(cpu_mask::thread_mask(), before);
    }
}
