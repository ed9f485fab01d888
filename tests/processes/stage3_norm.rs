//! ZeRO stage 3's per-layer bound through norms between linear layers: `nn::LayerNorm` (with
//! and without beta) gathers gamma and beta for its op alone, and `nn::RmsNorm`
//! (`normalized * gamma.unsqueeze()`: a reshape of gamma, then a broadcast product) gathers
//! gamma for its product alone; each gathers gamma again for its input's gradient, and ends
//! where stage 2 does (bit for bit on 2 processes, to rounding on 3).

use super::*;

use burn::nn::{LayerNorm, LayerNormConfig, RmsNorm, RmsNormConfig};

const HIDDEN: usize = 24;

/// Which norm `Normed` puts between its linear layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum NormKind {
    /// A `LayerNorm`, then a `LayerNorm` without beta.
    Layer,
    /// Two `RmsNorm`s.
    Rms,
}

#[derive(Module, Debug)]
enum Norm<B: Backend> {
    Layer(LayerNorm<B>),
    Rms(RmsNorm<B>),
}

impl<B: Backend> Norm<B> {
    fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Norm::Layer(norm) => norm.forward(x),
            Norm::Rms(norm) => norm.forward(x),
        }
    }
}

/// linear → norm → linear → norm → linear head.
#[derive(Module, Debug)]
pub(super) struct Normed<B: Backend> {
    first: Linear<B>,
    norm: Norm<B>,
    second: Linear<B>,
    second_norm: Norm<B>,
    head: Linear<B>,
}

impl<B: Backend> Normed<B> {
    pub(super) fn new(kind: NormKind, device: &B::Device) -> Self {
        B::seed(device, 13);
        let norm = |beta: bool| match kind {
            NormKind::Layer => {
                Norm::Layer(LayerNormConfig::new(HIDDEN).with_bias(beta).init(device))
            }
            NormKind::Rms => Norm::Rms(RmsNormConfig::new(HIDDEN).init(device)),
        };
        Normed {
            first: LinearConfig::new(FEATURES, HIDDEN).init(device),
            norm: norm(true),
            second: LinearConfig::new(HIDDEN, HIDDEN).init(device),
            second_norm: norm(false),
            head: LinearConfig::new(HIDDEN, CLASSES).init(device),
        }
    }

    fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let relu = Relu::new();
        let h = relu.forward(self.norm.forward(self.first.forward(x)));
        let h = relu.forward(self.second_norm.forward(self.second.forward(h)));
        self.head.forward(h)
    }

    /// The logits of `x`'s rows, read as sequences where `sequences` (`on_sequences`: the
    /// parameters' gradients then sum over two broadcast dimensions).
    pub(super) fn logits(&self, x: Tensor<B, 2>, sequences: bool) -> Tensor<B, 2> {
        match sequences {
            true => on_sequences(x, |x| self.forward(x)),
            false => self.forward(x),
        }
    }
}

/// `Normed`'s parameters, its linear layers' gathered `linear` bytes a value and the norms'
/// in f32 (autocast runs a layer norm in f32, and an RMS norm's promote-class product reads
/// gamma in f32): every weight but the first layer's (whose input is the data) gathered again
/// in backward, and every gamma (its input, a linear layer's output, needs a gradient).
pub(super) fn normed_layers(kind: NormKind, linear: u64) -> Vec<Vec<Gathered>> {
    let norm = |beta: bool| match (kind, beta) {
        (NormKind::Layer, true) => weight_and_bias(HIDDEN, HIDDEN, 4, true),
        _ => vec![(HIDDEN, 4, true)],
    };
    vec![
        weight_and_bias(FEATURES * HIDDEN, HIDDEN, linear, false),
        norm(true),
        weight_and_bias(HIDDEN * HIDDEN, HIDDEN, linear, true),
        norm(false),
        weight_and_bias(HIDDEN * CLASSES, CLASSES, linear, true),
    ]
}

#[derive(Debug, Serialize, Deserialize)]
struct NormRun {
    training: Training,
    kind: NormKind,
    /// The layers read 3-D inputs (`Normed::logits`).
    sequences: bool,
}

fn norm_worker(args: &NormRun) -> Stage3Report {
    let model = Normed::<TrainingBackend>::new(args.kind, &Default::default());
    // Under autocast every linear layer is cast (the net is tiny: `SmallOps::Cast`).
    let config =
        AccelerateConfig::new().with_small_ops(Some(burn_accelerate::autocast::SmallOps::Cast));
    let sequences = args.sequences;
    let forward = move |model: &Normed<_>, x| model.logits(x, sequences);
    observed_training(args.training, config, model, samples, forward, ())
}

/// Stage 3 through layer norms and RMS norms: from the first step on, at most one layer's gathered
/// parameters are whole at a time (a linear layer's weight and bias, a layer norm's gamma and beta,
/// or an RMS norm's gamma, whose reshape gathers nothing), nothing gathered is left whole after the
/// backward pass, each batch sends what stage 3's formula says
/// (`stage_3_reduce_scatters_each_gradient_in_backward_and_sends_what_the_formula_says`, with
/// a norm's gamma gathered again in backward for its input's gradient, as a linear layer's weight
/// above the first is), and the parameters end where stage 2's do (bit for bit on 2 processes, to
/// rounding on 3). Under bf16 autocast the linear layers gather halves and the norms gather f32 (a
/// layer norm runs in f32; an RMS norm's product reads gamma in f32: its bound there, on a model
/// sharded from the start, `stage3_bounds`).
#[test]
fn stage_3_holds_one_layer_or_rms_norms_gathered_parameters_at_a_time_and_ends_where_stage_2_does()
{
    const TEST: &str = "stage3_norm::stage_3_holds_one_layer_or_rms_norms_gathered_parameters_at_a_time_and_ends_where_stage_2_does";
    if let Some(args) = worker::<NormRun>() {
        return report(&norm_worker(&args));
    }
    let (layer, rms, bf16) = (NormKind::Layer, NormKind::Rms, Some(Precision::Bf16));
    for (kind, processes, grad_accum, sequences, precision) in [
        (layer, 2, 1, false, None),
        (layer, 2, 2, false, None),
        (layer, 3, 1, false, None),
        (layer, 3, 2, false, None),
        (layer, 2, 2, true, None),
        (layer, 2, 1, false, bf16),
        (layer, 3, 2, true, bf16),
        (rms, 2, 1, false, None),
        (rms, 2, 2, false, None),
        (rms, 3, 1, false, None),
        (rms, 3, 2, false, None),
        (rms, 2, 2, true, None),
        (rms, 2, 2, true, bf16),
        (rms, 3, 1, true, bf16),
    ] {
        let linear = if precision.is_some() { 2 } else { 4 };
        let expected = Stage3Expected::new(normed_layers(kind, linear), processes);
        // Built whole: the first window gathers nothing.
        let training = Training {
            zero_stage: 3,
            precision,
            grad_accum,
            batches: 3 * grad_accum + 1,
            prepare: false,
        };
        let args = |training| NormRun {
            training,
            kind,
            sequences,
        };
        stage_3_against_stage_2::<_, ()>(
            TEST,
            &expected,
            training,
            (Peak::OneLayer, Agreement::Bits),
            args,
        );
    }
}
