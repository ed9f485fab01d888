//! Burn's records as bytes and back (Burn's `NamedMpk` format, in full precision), without
//! Burn's panics: the bytes may come from a damaged file (a checkpoint) or another process (a
//! ZeRO run's optimizer state), so what is wrong with them is an error, not a panic.
//!
//! Burn's `from_item`, which builds a record's tensors from what decoded, has no error: it
//! panics on a parameter id that is not one ("Invalid id.", or a slice index past 8 bytes for
//! a long one), on a tensor whose shape has another rank than the record's type says, and on
//! a shape its data does not fill. Every one of those is checked here first, in one walk of
//! the MessagePack ([`check_tensors`]), so that Burn is never handed them: a panic, even a
//! caught one, runs the panic hook, which with `RUST_BACKTRACE=1` symbolises a backtrace
//! (megabytes, SECURITY.md). The catch around `from_item` stays for what the walk cannot know,
//! and names itself ([`BURN_PANICKED`]) so that the property tests fail when it is reached.

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;

use burn::module::{Module, ParamId};
use burn::record::{BurnRecord, FullPrecisionSettings, NamedMpkBytesRecorder, Record, Recorder};
use burn::tensor::backend::Backend;

/// The recorder of every record a checkpoint holds and a process sends.
pub(crate) type Bytes = NamedMpkBytesRecorder<FullPrecisionSettings>;

/// How the reason of a record starts when Burn panicked building it, in spite of
/// [`check_tensors`]: the last resort, which no input of the property tests may reach.
pub(crate) const BURN_PANICKED: &str = "holds a value Burn cannot load";

/// The shape of each parameter of the model a record is for, by its path in the record
/// (`item.first.weight.param`), so that a tensor of another rank is refused before Burn's
/// `from_item` panics on it. Empty for a record of no model (an optimizer's, whose states
/// carry their rank in their `RankN` variant).
#[derive(Debug, Default)]
pub(crate) struct Shapes(HashMap<String, (String, Vec<usize>)>);

impl Shapes {
    /// The parameters of `model`, from the placement walk (which creates no lazy parameter).
    pub(crate) fn of_model<B: Backend, M: Module<B>>(model: &M) -> Self {
        Self(
            crate::placement::walk::walk::<B, M>(model)
                .params
                .into_iter()
                .map(|param| {
                    (
                        format!("item.{}.param", param.path),
                        (param.path, param.shape),
                    )
                })
                .collect(),
        )
    }
}

/// A record from its bytes ([`Bytes`]'s), on `device`; what is wrong with them otherwise.
///
/// The bytes are first walked ([`check_tensors`], which refuses what Burn would panic on),
/// then decoded (serde's errors are Burn's), then the record is built.
pub(crate) fn from_bytes<B: Backend, R: Record<B>>(
    bytes: Vec<u8>,
    device: &B::Device,
) -> Result<R, String> {
    check_tensors(&bytes, &Shapes::default())?;
    build(bytes, device)
}

/// The record of `bytes` that [`check_tensors`] passed, on `device`.
///
/// Burn's `from_item` is run with its panic caught and turned into the reason (starting with
/// [`BURN_PANICKED`]): the walk refuses everything Burn is known to panic on, but the bytes
/// may come from a damaged file or another process, and a panic must not end the run.
pub(crate) fn build<B: Backend, R: Record<B>>(
    mut bytes: Vec<u8>,
    device: &B::Device,
) -> Result<R, String> {
    let record: BurnRecord<R::Item<FullPrecisionSettings>, B> =
        Recorder::<B>::load_item(&Bytes::default(), &mut bytes).map_err(|e| e.to_string())?;
    drop(bytes);
    std::panic::catch_unwind(AssertUnwindSafe(|| R::from_item(record.item, device))).map_err(
        |panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a value Burn cannot build".into());
            format!("{BURN_PANICKED} ({what})")
        },
    )
}

/// Checks, before Burn builds a record, what Burn's `from_item` would panic on:
/// - each tensor in `bytes` (a map with `bytes`, `shape` and `dtype`, Burn's `TensorData`)
///   holds as many bytes as its shape says (Burn does not check: a record whose shape claims
///   2^40 rows over 48 bytes of data loads, a tensor whose shape says nothing true about its
///   data), and has at least one dimension;
/// - a tensor of a model's parameter has the model's shape (`shapes`), and one of an
///   optimizer's state the rank its `RankN` variant says;
/// - each parameter id (a parameter's `id`, the key of an optimizer's state) is one Burn reads.
///
/// The walk keeps nothing but the path to the value it is in. It also refuses a record nested
/// deeper than [`MAX_DEPTH`], before any recursive decoder (this walk, or serde's skipping of
/// a field) can overflow a thread's stack on it.
pub(crate) fn check_tensors(bytes: &[u8], shapes: &Shapes) -> Result<(), String> {
    walk(bytes, shapes).map(drop)
}

/// The first of the model's parameters (`shapes`, in the order of their paths) that `bytes`
/// hold no tensor for, with its shape: what to name when a record that [`check_tensors`]
/// passed does not decode as the model's (serde names only the first field it missed, a
/// module's, not a parameter). `None` when every one is there, or the bytes do not walk.
pub(crate) fn first_missing(bytes: &[u8], shapes: &Shapes) -> Option<(String, Vec<usize>)> {
    let seen = walk(bytes, shapes).ok()?;
    let mut missing: Vec<&(String, Vec<usize>)> = shapes
        .0
        .iter()
        .filter(|(path, _)| !seen.contains(*path))
        .map(|(_, param)| param)
        .collect();
    missing.sort();
    missing.first().map(|&param| param.clone())
}

/// The shape `bytes` hold for each of the model's parameters (`shapes`), by the parameter's
/// path in the model (`first.weight`), whatever it is: what a sharded checkpoint's model file
/// is checked by, whose parameters of other processes have no elements. Read in the walk of
/// [`check_tensors`] (which checks everything else it checks, but not the shapes against the
/// model's), without building a tensor. A parameter the bytes hold no tensor for is absent.
///
/// # Errors
/// What [`check_tensors`] refuses, but a parameter of another shape than the model's.
pub(crate) fn parameter_shapes(
    bytes: &[u8],
    shapes: &Shapes,
) -> Result<HashMap<String, Vec<usize>>, String> {
    let seen = walk_with(bytes, shapes, false)?;
    Ok(seen
        .into_iter()
        .filter_map(|(path, dims)| Some((shapes.0.get(&path)?.0.clone(), dims)))
        .collect())
}

// Walks `bytes` as `check_tensors` says; the record paths of the model's parameters found.
fn walk(bytes: &[u8], shapes: &Shapes) -> Result<HashSet<String>, String> {
    walk_with(bytes, shapes, true).map(|seen| seen.into_keys().collect())
}

// Walks `bytes`, refusing a parameter of another shape than the model's where `compare`; the
// record paths of the model's parameters found, with the shapes they have.
fn walk_with(
    bytes: &[u8],
    shapes: &Shapes,
    compare: bool,
) -> Result<HashMap<String, Vec<usize>>, String> {
    let mut deserializer = rmp_serde::Deserializer::from_read_ref(bytes);
    deserializer.set_max_depth(MAX_DEPTH);
    let mut context = Context {
        path: Vec::new(),
        rank: None,
        shapes,
        compare,
        seen: HashMap::new(),
    };
    serde::de::DeserializeSeed::deserialize(Walk(&mut context), &mut deserializer)
        .map_err(|e| e.to_string())?;
    Ok(context.seen)
}

/// The deepest nesting a record may have: Burn's records nest as deep as their modules, a
/// few levels (MessagePack's own limit, 1024, still overflows a test thread's 2 MiB stack in
/// a debug build).
const MAX_DEPTH: usize = 64;

/// The most dimensions a shape is read with (Burn's tensors have a handful).
const MAX_DIMS: usize = 64;

/// The longest bytes read as text (a key, an id or a dtype's name is short; tensors' data are
/// not read as text).
const MAX_TEXT: usize = 64;

/// The highest rank of Burn's optimizer states (`AdaptorRecordV1::Rank8`).
const MAX_STATE_RANK: usize = 8;

/// Whether `id` is a parameter id Burn's `ParamId::deserialize` reads without panicking.
///
/// `try_deserialize` copies the base32 decoding of `id` into 8 bytes without checking its
/// length, so an id of more than 14 base32 characters that decodes panics inside it: those are
/// refused before it is asked (none is one Burn writes: 8 bytes are 13 characters).
fn is_param_id(id: &str) -> bool {
    let base32 = |c: u8| c.is_ascii_digit() || matches!(c.to_ascii_lowercase(), b'a'..=b'v');
    if id.len() > 14 && id.bytes().all(base32) {
        return false;
    }
    ParamId::try_deserialize(id).is_some()
}

/// The rank of an optimizer state's variant (`"Rank2"`: 2).
fn state_rank(key: &str) -> Option<usize> {
    let rank: usize = key.strip_prefix("Rank")?.parse().ok()?;
    (rank <= MAX_STATE_RANK && key.len() == 5).then_some(rank)
}

/// What the walk knows where it is.
struct Context<'s> {
    /// The keys (and sequence indices) from the record's root to the value walked.
    path: Vec<String>,
    /// The rank of the optimizer state the value is in (its `RankN` variant), if it is in one.
    rank: Option<usize>,
    /// The model's parameters, by path.
    shapes: &'s Shapes,
    /// Whether a parameter of another shape than the model's is refused.
    compare: bool,
    /// The paths of the model's parameters walked so far, with their shapes (at most one
    /// each: bounded by the model, not by the bytes).
    seen: HashMap<String, Vec<usize>>,
}

/// One value of the walk of [`check_tensors`], noted as [`Seen`] (and checked, where it is a
/// tensor or a parameter).
struct Walk<'c, 's>(&'c mut Context<'s>);

impl<'de> serde::de::DeserializeSeed<'de> for Walk<'_, '_> {
    type Value = Seen;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Seen, D::Error> {
        d.deserialize_any(self)
    }
}

/// What a value was, as far as the checks need.
enum Seen {
    /// Anything else (walked).
    Other,
    /// A string (a key, an id, or a dtype such as `"F32"`).
    Text(String),
    /// A number that is not negative (a dimension of a shape: serde reads a `usize` from a
    /// signed MessagePack integer too).
    Number(u64),
    /// A sequence of this many elements, with its numbers when it holds only numbers that are
    /// not negative, at most [`MAX_DIMS`] (a shape).
    Items(u64, Option<Vec<u64>>),
    /// Bytes: how many, their text when they are UTF-8 of at most [`MAX_TEXT`] bytes (serde
    /// reads a string, a key, an id, a dtype's name, from MessagePack's bytes too), and
    /// whether each is 0 or 1 (a native bool).
    Bytes(u64, Option<String>, bool),
    /// A map of one entry, a name and its text (`{"Bool": "Native"}`: an enum's variant).
    Variant(String, String),
    /// A tensor, checked.
    Tensor,
    /// A map that holds an optimizer's state of one parameter (`{"RankN": ...}`, or
    /// `{"V1": {"RankN": ...}}`): the key it is under is the parameter's id.
    State,
}

impl Seen {
    /// The string serde would read from it.
    fn text(self) -> Option<String> {
        match self {
            Self::Text(text) | Self::Bytes(_, Some(text), _) => Some(text),
            _ => None,
        }
    }
}

// Walks a map, checking it where it is a tensor or a parameter.
fn walk_map<'de, A: serde::de::MapAccess<'de>>(
    context: &mut Context<'_>,
    mut map: A,
) -> Result<Seen, A::Error> {
    let (mut data, mut shape, mut dtype, mut id, mut param) = (None, None, None, None, false);
    let (mut state, mut entries, mut single) = (false, 0usize, None);
    while let Some(key) = map.next_key_seed(Walk(&mut *context))? {
        entries += 1;
        // A key of bytes that cannot be read as text here is named by its length; serde may
        // still read it as a string, so it can be no parameter's id.
        let (key, readable) = match key {
            Seen::Text(text) | Seen::Bytes(_, Some(text), _) => (text, true),
            Seen::Bytes(len, None, _) => (format!("<{len} bytes>"), false),
            // Serde reads a struct's field and an enum's variant from its index too, which
            // would pass a tensor, a parameter or an optimizer state by every check here; the
            // only map of Burn's records is keyed by parameter ids, and fields by names.
            _ => {
                return Err(serde::de::Error::custom(format!(
                    "a key that is not a name in `{}`, which no Burn record holds",
                    context.path.join(".")
                )));
            }
        };
        let rank = state_rank(&key);
        let outer = context.rank;
        if rank.is_some() {
            context.rank = rank;
            state = true;
        }
        context.path.push(key);
        let value = map.next_value_seed(Walk(&mut *context));
        context.rank = outer;
        let value = value?;
        let key = context.path.pop().unwrap_or_default();
        match (key.as_str(), value) {
            ("bytes", value) => data = Some(value),
            ("shape", value) => shape = Some(value),
            ("dtype", value) => dtype = Some(value),
            ("id", Seen::Bytes(len, None, _)) => id = Some(format!("<{len} bytes>")),
            ("id", value) => id = value.text(),
            ("param", _) => param = true,
            ("V1", Seen::State) => state = true,
            (_, Seen::State) if !readable || !is_param_id(&key) => {
                return Err(serde::de::Error::custom(format!(
                    "Invalid id {key:?} of the optimizer state at `{}`: not a parameter id \
                     Burn writes",
                    context.path.join(".")
                )));
            }
            (_, value) => {
                if entries == 1 {
                    single = value.text().map(|text| (key, text));
                }
            }
        }
    }
    if let (Some(id), true) = (&id, param) {
        check_id(context, id).map_err(serde::de::Error::custom)?;
    }
    if let (Some(data), Some(shape), Some(dtype)) = (data, shape, dtype) {
        check_tensor(context, data, shape, dtype).map_err(serde::de::Error::custom)?;
        return Ok(Seen::Tensor);
    }
    Ok(match single {
        _ if state => Seen::State,
        Some((name, text)) if entries == 1 => Seen::Variant(name, text),
        _ => Seen::Other,
    })
}

// A parameter's id, where `context` is.
fn check_id(context: &Context<'_>, id: &str) -> Result<(), String> {
    if is_param_id(id) {
        return Ok(());
    }
    Err(format!(
        "Invalid id {id:?} of parameter `{}`: not a parameter id Burn writes",
        context.path.join(".")
    ))
}

// A tensor's data, shape and dtype (as they were seen), where `context` is: what Burn would
// panic on or allocate for, refused.
fn check_tensor(
    context: &mut Context<'_>,
    data: Seen,
    shape: Seen,
    dtype: Seen,
) -> Result<(), String> {
    let path = context.path.join(".");
    let (len, bools) = match data {
        Seen::Bytes(len, _, bools) => (len, bools),
        Seen::Items(len, _) => (len, false),
        _ => return Err(format!("tensor `{path}` has data that are not bytes")),
    };
    let Seen::Items(_, Some(dims)) = shape else {
        return Err(format!(
            "tensor `{path}` has a shape that is not a list of at most {MAX_DIMS} dimensions"
        ));
    };
    // A name (`"F32"`), or a variant and its name (`{"Bool": "Native"}`); quantized tensors
    // (a variant holding a scheme) are none this crate writes, and not read.
    let (name, dtype) = match dtype {
        Seen::Text(name) | Seen::Bytes(_, Some(name), _) => {
            let de = serde::de::value::StrDeserializer::<serde::de::value::Error>::new(&name);
            let dtype = <burn::tensor::DType as serde::Deserialize>::deserialize(de).ok();
            (name, dtype)
        }
        Seen::Variant(variant, store) if variant == "Bool" => {
            let de = serde::de::value::StrDeserializer::<serde::de::value::Error>::new(&store);
            let dtype = <burn::tensor::BoolStore as serde::Deserialize>::deserialize(de)
                .ok()
                .map(burn::tensor::DType::Bool);
            (format!("Bool({store})"), dtype)
        }
        _ => (String::new(), None),
    };
    let Some(dtype) = dtype else {
        return Err(format!(
            "tensor `{path}` has a dtype {name:?} that is not one of Burn's unquantized ones"
        ));
    };
    if dims.is_empty() {
        return Err(format!(
            "tensor `{path}` has no dimensions, which no tensor of Burn's has"
        ));
    }
    if let Some(rank) = context.rank
        && dims.len() != rank
    {
        return Err(format!(
            "tensor `{path}` has shape {dims:?} in an optimizer state of rank {rank}"
        ));
    }
    if let Some((param, expected)) = context.shapes.0.get(&path).filter(|_| context.compare)
        && !dims
            .iter()
            .map(|&d| usize::try_from(d).ok())
            .eq(expected.iter().map(|&d| Some(d)))
    {
        return Err(format!(
            "parameter `{param}` has shape {dims:?} in the record, {expected:?} in the model: \
             the checkpoint is of another model (resume with the model that saved it, or \
             start without this checkpoint directory)"
        ));
    }
    if context.shapes.0.contains_key(&path) {
        // A dimension past `usize` is no model's: it stays one no model has.
        let shape = dims
            .iter()
            .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
            .collect();
        context.seen.insert(path.clone(), shape);
    }
    // Burn's count of elements is a product in `usize`, of every dimension in turn.
    let needs = dims
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .filter(|&n| usize::try_from(n).is_ok())
        .and_then(|n| n.checked_mul(dtype.size() as u64));
    if needs != Some(len) {
        let needs = needs.map_or_else(|| "more than 2^64".to_string(), |n| n.to_string());
        return Err(format!(
            "tensor `{path}` has shape {dims:?} of {name}, which needs {needs} bytes, and holds \
             {len}"
        ));
    }
    if dtype == burn::tensor::DType::Bool(burn::tensor::BoolStore::Native) && !bools {
        return Err(format!(
            "tensor `{path}` of bools holds bytes that are neither 0 nor 1"
        ));
    }
    Ok(())
}

// Whether serde would read `data`, `shape` and `dtype` as a tensor's fields.
fn is_tensor(data: &Seen, shape: &Seen, dtype: &Seen) -> bool {
    matches!(data, Seen::Bytes(..) | Seen::Text(_) | Seen::Items(..))
        && matches!(shape, Seen::Items(..) | Seen::Bytes(..))
        && matches!(
            dtype,
            Seen::Text(_) | Seen::Bytes(..) | Seen::Number(_) | Seen::Variant(..)
        )
}

impl<'de> serde::de::Visitor<'de> for Walk<'_, '_> {
    type Value = Seen;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a Burn record")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Seen, E> {
        Ok(Seen::Other)
    }
    fn visit_i64<E>(self, v: i64) -> Result<Seen, E> {
        Ok(u64::try_from(v).map_or(Seen::Other, Seen::Number))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Seen, E> {
        Ok(Seen::Number(v))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Seen, E> {
        Ok(Seen::Other)
    }
    fn visit_str<E>(self, v: &str) -> Result<Seen, E> {
        Ok(Seen::Text(v.to_string()))
    }
    fn visit_bytes<E>(self, v: &[u8]) -> Result<Seen, E> {
        let text = (v.len() <= MAX_TEXT)
            .then(|| std::str::from_utf8(v).ok())
            .flatten();
        let bools = v.iter().all(|&b| b <= 1);
        Ok(Seen::Bytes(v.len() as u64, text.map(str::to_string), bools))
    }
    fn visit_unit<E>(self) -> Result<Seen, E> {
        Ok(Seen::Other)
    }
    fn visit_none<E>(self) -> Result<Seen, E> {
        Ok(Seen::Other)
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Seen, D::Error> {
        d.deserialize_any(self)
    }

    // Elements are named by their index in the path (`layers.0`), as Burn's module paths
    // are. Serde reads a struct from a sequence of its fields too: a tensor as `[data,
    // shape, dtype]` and a parameter as `[id, tensor]` are checked as the maps are.
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Seen, A::Error> {
        let (mut count, mut numbers, mut first) = (0u64, Some(Vec::new()), Vec::new());
        loop {
            self.0.path.push(count.to_string());
            let item = seq.next_element_seed(Walk(&mut *self.0));
            self.0.path.pop();
            let Some(item) = item? else {
                break;
            };
            count += 1;
            match (&item, numbers.as_mut()) {
                (Seen::Number(d), Some(dims)) if dims.len() < MAX_DIMS => dims.push(*d),
                _ => numbers = None,
            }
            if first.len() < 3 {
                first.push(item);
            }
        }
        let mut first = first.into_iter();
        match (count, first.next(), first.next(), first.next()) {
            // Three values serde would read as a tensor's data, shape and dtype, in whatever
            // form it accepts them (data as bytes, text or a list of numbers; a shape as a list
            // or as bytes; a dtype as a name, an index or a variant): checked as a map is, and
            // refused unless in the form Burn writes.
            (3, Some(data), Some(shape), Some(dtype)) if is_tensor(&data, &shape, &dtype) => {
                check_tensor(self.0, data, shape, dtype).map_err(serde::de::Error::custom)?;
                Ok(Seen::Tensor)
            }
            (2, Some(id), Some(Seen::Tensor), None) => {
                let id = match id {
                    Seen::Bytes(len, None, _) => Some(format!("<{len} bytes>")),
                    id => id.text(),
                };
                if let Some(id) = id {
                    check_id(self.0, &id).map_err(serde::de::Error::custom)?;
                }
                Ok(Seen::Other)
            }
            _ => Ok(Seen::Items(count, numbers)),
        }
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Seen, A::Error> {
        walk_map(self.0, map)
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::backend::Flex;

    use super::*;

    // The walk recurses: MessagePack nested a million deep must be refused by the decoder's
    // depth limit, not overflow the stack.
    #[test]
    fn a_record_nested_a_million_deep_is_refused() {
        let mut bytes = vec![0x91u8; 1_000_000];
        bytes.push(0xc0);
        let err = from_bytes::<Flex, burn::nn::LinearRecord<Flex>>(bytes, &Default::default())
            .err()
            .expect("not a record");
        assert!(err.contains("depth limit exceeded"), "{err}");
    }
}
