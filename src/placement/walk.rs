//! One pass over a module: its parameters with their paths, and its submodule tree.
//!
//! Paths are the names Burn's `ModuleVisitor` announces through `enter_module`, joined with
//! dots (`"blocks.0.fc1.weight"`), the same names Burn's records and `burn-store` use.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Int, Shape, Tensor, get_device_settings};

/// What kind of tensor a parameter is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// A float tensor (weights, biases, running statistics).
    Float,
    /// An int tensor.
    Int,
    /// A bool tensor.
    Bool,
}

/// One parameter as the walk found it.
#[derive(Debug, Clone)]
pub(crate) struct ParamInfo<D> {
    pub path: String,
    pub kind: ParamKind,
    pub device: D,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: u64,
    pub initialized: bool,
}

/// A submodule: what `enter_module` announced, and what lies under it.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub path: String,
    /// The `#[derive(Module)]` type name (`"Linear"`), for structs and enums.
    pub type_name: Option<String>,
    pub children: Vec<usize>,
    /// Parameters visited while this node was innermost (a parameter field is its own node).
    pub params: Vec<usize>,
    /// Bytes of every parameter under this node.
    pub bytes: u64,
}

/// The walk's result: parameters in visit order and the tree over them (node 0 is the root).
#[derive(Debug, Clone)]
pub(crate) struct Walk<D> {
    pub params: Vec<ParamInfo<D>>,
    pub nodes: Vec<Node>,
}

impl<D> Walk<D> {
    /// Every parameter index under `node`, in visit order.
    pub fn params_under(&self, node: usize, out: &mut Vec<usize>) {
        out.extend(&self.nodes[node].params);
        for &child in &self.nodes[node].children {
            self.params_under(child, out);
        }
    }
}

/// Walks `module` without initialising lazy parameters.
pub(crate) fn walk<B: Backend, M: Module<B>>(module: &M) -> Walk<B::Device> {
    let mut visitor = Walker::<B> {
        walk: Walk {
            params: Vec::new(),
            nodes: vec![Node {
                path: String::new(),
                type_name: None,
                children: Vec::new(),
                params: Vec::new(),
                bytes: 0,
            }],
        },
        stack: vec![0],
    };
    module.visit(&mut visitor);
    visitor.walk
}

/// `a.b` from `a` and `b`; the root's children have bare names.
pub(crate) fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_string()
    } else {
        format!("{parent}.{name}")
    }
}

struct Walker<B: Backend> {
    walk: Walk<B::Device>,
    stack: Vec<usize>,
}

impl<B: Backend> Walker<B> {
    fn top(&self) -> usize {
        *self.stack.last().unwrap_or(&0)
    }

    fn record(
        &mut self,
        kind: ParamKind,
        device: B::Device,
        dtype: DType,
        shape: Shape,
        initialized: bool,
    ) {
        let bytes = (shape.num_elements() as u64).saturating_mul(dtype.size() as u64);
        let top = self.top();
        let index = self.walk.params.len();
        self.walk.params.push(ParamInfo {
            path: self.walk.nodes[top].path.clone(),
            kind,
            device,
            dtype,
            shape: shape.to_vec(),
            bytes,
            initialized,
        });
        self.walk.nodes[top].params.push(index);
        for &node in &self.stack {
            self.walk.nodes[node].bytes += bytes;
        }
    }
}

// A parameter Burn has not created yet (modules initialise lazily) is reported from what it
// will be created with, so that reporting on or planning a model too big for one device does
// not allocate it there. Its dtype is then the device's default, which is what Burn's
// initialisers create.
impl<B: Backend> ModuleVisitor<B> for Walker<B> {
    // `container_type` is the type whose field (or element) is being entered, so it names the
    // parent node, not the one entered.
    fn enter_module(&mut self, name: &str, container_type: &str) {
        let parent = self.top();
        if self.walk.nodes[parent].type_name.is_none() {
            self.walk.nodes[parent].type_name = container_type
                .strip_prefix("Struct:")
                .or_else(|| container_type.strip_prefix("Enum:"))
                .map(str::to_string);
        }
        let index = self.walk.nodes.len();
        self.walk.nodes.push(Node {
            path: join(&self.walk.nodes[parent].path, name),
            type_name: None,
            children: Vec::new(),
            params: Vec::new(),
            bytes: 0,
        });
        self.walk.nodes[parent].children.push(index);
        self.stack.push(index);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        if self.stack.len() > 1 {
            self.stack.pop();
        }
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if param.is_initialized() {
            let tensor = param.val();
            self.record(
                ParamKind::Float,
                tensor.device(),
                tensor.dtype(),
                tensor.shape(),
                true,
            );
        } else {
            let device = param.lazy_device();
            let dtype = get_device_settings::<B>(&device).float_dtype.into();
            self.record(ParamKind::Float, device, dtype, param.lazy_shape(), false);
        }
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<B, D, Int>>) {
        if param.is_initialized() {
            let tensor = param.val();
            self.record(
                ParamKind::Int,
                tensor.device(),
                tensor.dtype(),
                tensor.shape(),
                true,
            );
        } else {
            let device = param.lazy_device();
            let dtype = get_device_settings::<B>(&device).int_dtype.into();
            self.record(ParamKind::Int, device, dtype, param.lazy_shape(), false);
        }
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<B, D, Bool>>) {
        if param.is_initialized() {
            let tensor = param.val();
            self.record(
                ParamKind::Bool,
                tensor.device(),
                tensor.dtype(),
                tensor.shape(),
                true,
            );
        } else {
            let device = param.lazy_device();
            let dtype = get_device_settings::<B>(&device).bool_dtype.into();
            self.record(ParamKind::Bool, device, dtype, param.lazy_shape(), false);
        }
    }
}
