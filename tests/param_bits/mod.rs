//! The bits of a model's parameters, for the tests that compare two trainings bit for bit.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// Every parameter value's bits (NaN payloads included), in visiting order; parameter ids,
/// which differ between runs, are left out.
pub fn param_bits<B: Backend, M: Module<B>>(model: &M) -> Vec<u32> {
    struct Bits(Vec<u32>);
    impl<B: Backend> ModuleVisitor<B> for Bits {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let values = param.val().into_data().convert::<f32>();
            self.0
                .extend(values.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()));
        }
    }
    let mut bits = Bits(Vec::new());
    model.visit(&mut bits);
    bits.0
}
