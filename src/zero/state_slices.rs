//! A parameter's optimizer state cut along ZeRO stage 3's flat slices, and joined back whole.
//!
//! At stage 3 (FSDP's `FULL_SHARD`) each process steps only its flat slice of every parameter
//! ([`slice_range`]), as a tensor of shape `[1, .., 1, len]`, so an elementwise optimizer's
//! state of the parameter (Adam's moments, SGD's velocity) has the slice's shape on each
//! process. A checkpoint holds the state whole, as a run at stages 0 to 2 writes it, so that it
//! resumes at any stage on any number of processes: consolidating it joins every process's
//! slices ([`join_state`]), resuming cuts the whole state to a process's slice
//! ([`slice_state`]).
//!
//! Both work on the MessagePack of a record holding one parameter's state (Burn's `NamedMpk`,
//! [`Bytes`](crate::record_bytes::Bytes)'s), whatever optimizer wrote it: every tensor of the
//! parameter's shape (or the slice's) is cut (or joined), every other value is copied. A
//! tensor's values are one MessagePack binary (Burn's `TensorData.bytes`), borrowed from the
//! input and copied once into the output, so a state of tens of megabytes costs its size, not
//! a decoded value per element.

use burn::tensor::DType;
use rmpv::ValueRef;

use super::sharding::{slice_len, slice_range};

/// The deepest nesting read: Burn's records nest a few levels (an optimizer's state, under
/// `item`, its version and rank, a handful), and the reader recurses, so bytes nested deeper
/// are refused before they can overflow a thread's stack (as `record_bytes`'s walk does).
const MAX_DEPTH: usize = 64;

/// The state of one parameter of shape `shape` (the MessagePack of its record), cut to
/// process `rank`'s flat slice of `processes`: every tensor of shape `shape` holds the
/// values of [`slice_range`], then zeros up to [`slice_len`], with shape `[1, .., 1, len]`
/// (the parameter's rank, so an optimizer's `RankN` variant still holds). Other tensors and
/// values are kept.
///
/// # Errors
/// Bytes that are not one MessagePack value, a tensor Burn would not read, a state that holds
/// tensors but none of `shape` (another parameter's, or one already cut), a rank past the
/// processes.
pub(crate) fn slice_state(
    bytes: &[u8],
    shape: &[usize],
    processes: usize,
    rank: usize,
) -> Result<Vec<u8>, String> {
    if rank >= processes {
        return Err(format!(
            "process {rank}'s slice of {processes} processes: there is none (ranks 0..{processes})"
        ));
    }
    let values = count(shape)?;
    let (len, range) = (
        slice_len(values, processes),
        slice_range(values, processes, rank),
    );
    let record = read(bytes, "the state")?;
    let mut unmatched = Unmatched::default();
    let sliced = rewrite(&[&record], bytes.len(), &mut |path, tensors| {
        let tensor = &tensors[0];
        if !unmatched.matches(path, &tensor.shape, shape) {
            return Ok(None);
        }
        let size = tensor.dtype.size();
        Ok(Some(Replacement {
            shape: slice_shape(shape.len(), len),
            pieces: vec![&tensor.data[range.start * size..range.end * size]],
            // Zero in every unquantized dtype of Burn's (floats, integers, bools) is all-zero
            // bytes.
            zeros: (len - range.len()) * size,
        }))
    })?;
    unmatched.check(|| format!("the parameter's shape {shape:?}"))?;
    Ok(sliced)
}

/// The whole state of one parameter of shape `shape` (its record's MessagePack), from every
/// process's sliced state of it (`parts`, in rank order, as [`slice_state`] cuts them): every
/// tensor of the slice's shape is the parts' slices end to end, cut to the parameter's values
/// and shaped `shape`. Other values are part 0's.
///
/// # Errors
/// No parts; a part that is not one MessagePack value or holds a tensor Burn would not read;
/// parts of different structure (other keys, lengths, a tensor of another shape or dtype in
/// one part); parts that hold tensors but none of the slice's shape (slices over another
/// number of processes, or of another parameter).
pub(crate) fn join_state(parts: &[Vec<u8>], shape: &[usize]) -> Result<Vec<u8>, String> {
    let Some(first) = parts.first() else {
        return Err("no process's state to join".into());
    };
    let processes = parts.len();
    let values = count(shape)?;
    let sliced = slice_shape(shape.len(), slice_len(values, processes));
    let records = parts
        .iter()
        .enumerate()
        .map(|(rank, part)| read(part, &format!("process {rank}'s state")))
        .collect::<Result<Vec<_>, _>>()?;
    let records: Vec<&ValueRef<'_>> = records.iter().collect();
    let mut unmatched = Unmatched::default();
    let joined = rewrite(&records, first.len() * processes, &mut |path, tensors| {
        let tensor = &tensors[0];
        if let Some((rank, other)) = tensors
            .iter()
            .enumerate()
            .find(|(_, other)| (&other.shape, other.dtype) != (&tensor.shape, tensor.dtype))
        {
            return Err(format!(
                "tensor `{path}` is {:?} of shape {:?} in process 0's state and {:?} of shape \
                 {:?} in process {rank}'s",
                tensor.dtype, tensor.shape, other.dtype, other.shape
            ));
        }
        if !unmatched.matches(path, &tensor.shape, &sliced) {
            return Ok(None);
        }
        let size = tensor.dtype.size();
        Ok(Some(Replacement {
            shape: shape.to_vec(),
            // Each slice's own values, without its padding.
            pieces: tensors
                .iter()
                .enumerate()
                .map(|(rank, part)| &part.data[..slice_range(values, processes, rank).len() * size])
                .collect(),
            zeros: 0,
        }))
    })?;
    unmatched.check(|| {
        format!(
            "the slice's shape {sliced:?} (a parameter of shape {shape:?} over {processes} \
             processes): the states are slices over another number of processes, or of \
             another parameter"
        )
    })?;
    Ok(joined)
}

/// The values of a tensor of `shape`.
fn count(shape: &[usize]) -> Result<usize, String> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("a parameter of shape {shape:?} has more values than memory"))
}

/// The shape a process's slice of `len` values has, for a parameter of `rank` dimensions.
fn slice_shape(rank: usize, len: usize) -> Vec<usize> {
    let mut shape = vec![1; rank];
    if let Some(last) = shape.last_mut() {
        *last = len;
    }
    shape
}

/// The one MessagePack value `bytes` hold (`what` names them), its binaries borrowed.
fn read<'a>(bytes: &'a [u8], what: &str) -> Result<ValueRef<'a>, String> {
    let mut rest = bytes;
    let value = rmpv::decode::read_value_ref_with_max_depth(&mut rest, MAX_DEPTH)
        .map_err(|e| format!("{what} is not MessagePack: {e}"))?;
    if !rest.is_empty() {
        return Err(format!(
            "{what} is not one MessagePack value: {} bytes follow it",
            rest.len()
        ));
    }
    Ok(value)
}

/// Whether a walk met a tensor of the shape it cuts or joins, and else the first it met: a
/// state whose tensors are all of another shape is another parameter's (or cut for another
/// number of processes), which copied as it is would resume wrong.
#[derive(Default)]
struct Unmatched {
    matched: bool,
    first: Option<(String, Vec<usize>)>,
}

impl Unmatched {
    /// Whether the tensor at `path` of shape `shape` is of the shape `expected`, noted.
    fn matches(&mut self, path: &str, shape: &[usize], expected: &[usize]) -> bool {
        if shape == expected {
            self.matched = true;
        } else {
            self.first
                .get_or_insert_with(|| (path.to_string(), shape.to_vec()));
        }
        shape == expected
    }

    /// An error when tensors were met and none had the shape `expected` names.
    fn check(self, expected: impl FnOnce() -> String) -> Result<(), String> {
        match self.first {
            Some((path, shape)) if !self.matched => Err(format!(
                "no tensor of the state has {} (`{path}` has shape {shape:?})",
                expected()
            )),
            _ => Ok(()),
        }
    }
}

/// A tensor of the state (Burn's `TensorData`, a map of its `bytes`, `shape` and `dtype`),
/// checked: its bytes are as many as its shape and dtype say.
struct Tensor<'a> {
    data: &'a [u8],
    shape: Vec<usize>,
    dtype: DType,
}

/// What a tensor becomes: `pieces` end to end then `zeros` zero bytes, of shape `shape`.
struct Replacement<'a> {
    shape: Vec<usize>,
    pieces: Vec<&'a [u8]>,
    zeros: usize,
}

/// What a walk does with the tensors of every record at one place (named by its path): a
/// replacement, or `None` to keep the first record's.
type OnTensor<'f, 'a> =
    dyn FnMut(&str, &[Tensor<'a>]) -> Result<Option<Replacement<'a>>, String> + 'f;

/// The MessagePack of `records[0]` with its tensors replaced as `on_tensor` says, walking every
/// record in step (they must have the same structure; other values are the first's).
fn rewrite<'a>(
    records: &[&ValueRef<'a>],
    capacity: usize,
    on_tensor: &mut OnTensor<'_, 'a>,
) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(capacity);
    write(&mut out, records, &mut Vec::new(), on_tensor)?;
    Ok(out)
}

// Writes the values of every record at `path` (one place) into `out`.
fn write<'a>(
    out: &mut Vec<u8>,
    values: &[&ValueRef<'a>],
    path: &mut Vec<String>,
    on_tensor: &mut OnTensor<'_, 'a>,
) -> Result<(), String> {
    let first = values[0];
    for (rank, other) in values.iter().enumerate().skip(1) {
        if let Some(difference) = difference(first, other) {
            return Err(format!(
                "process {rank}'s state differs from process 0's at `{}`: {difference}",
                path.join(".")
            ));
        }
    }
    match first {
        ValueRef::Map(entries) => {
            let tensors = values
                .iter()
                .map(|value| tensor(value, path))
                .collect::<Result<Option<Vec<_>>, _>>()?;
            if let Some(tensors) = tensors {
                return match on_tensor(&path.join("."), &tensors)? {
                    Some(replacement) => write_tensor(out, entries, replacement),
                    None => write_value(out, first),
                };
            }
            rmp::encode::write_map_len(out, entries.len() as u32).map_err(encoding)?;
            for (i, (key, _)) in entries.iter().enumerate() {
                write_value(out, key)?;
                path.push(key_name(key));
                let inner: Vec<&ValueRef<'a>> = values.iter().map(|v| &map(v)[i].1).collect();
                write(out, &inner, path, on_tensor)?;
                path.pop();
            }
            Ok(())
        }
        ValueRef::Array(items) => {
            rmp::encode::write_array_len(out, items.len() as u32).map_err(encoding)?;
            for i in 0..items.len() {
                path.push(i.to_string());
                let inner: Vec<&ValueRef<'a>> = values.iter().map(|v| &array(v)[i]).collect();
                write(out, &inner, path, on_tensor)?;
                path.pop();
            }
            Ok(())
        }
        _ => write_value(out, first),
    }
}

// The entries of a map `difference` found to be one.
fn map<'v, 'a>(value: &'v ValueRef<'a>) -> &'v [(ValueRef<'a>, ValueRef<'a>)] {
    match value {
        ValueRef::Map(entries) => entries,
        _ => &[],
    }
}

// The items of an array `difference` found to be one.
fn array<'v, 'a>(value: &'v ValueRef<'a>) -> &'v [ValueRef<'a>] {
    match value {
        ValueRef::Array(items) => items,
        _ => &[],
    }
}

/// How `other`'s structure differs from `first`'s at one level (maps with the same keys in
/// the same order, arrays of the same length; other values may differ).
fn difference(first: &ValueRef<'_>, other: &ValueRef<'_>) -> Option<String> {
    match (first, other) {
        (ValueRef::Map(a), ValueRef::Map(b)) => {
            if a.len() != b.len() {
                return Some(format!("a map of {} entries, not {}", b.len(), a.len()));
            }
            a.iter()
                .zip(b)
                .find(|((a, _), (b, _))| a != b)
                .map(|((a, _), (b, _))| {
                    format!(
                        "key `{}` where process 0's has `{}`",
                        key_name(b),
                        key_name(a)
                    )
                })
        }
        (ValueRef::Array(a), ValueRef::Array(b)) => {
            (a.len() != b.len()).then(|| format!("an array of {} items, not {}", b.len(), a.len()))
        }
        (ValueRef::Map(_) | ValueRef::Array(_), _) | (_, ValueRef::Map(_) | ValueRef::Array(_)) => {
            Some(format!("{}, not {}", kind(other), kind(first)))
        }
        _ => None,
    }
}

// What a value is, in words.
fn kind(value: &ValueRef<'_>) -> &'static str {
    match value {
        ValueRef::Map(_) => "a map",
        ValueRef::Array(_) => "an array",
        ValueRef::Nil => "nil",
        ValueRef::Boolean(_) => "a bool",
        ValueRef::Integer(_) => "an integer",
        ValueRef::F32(_) | ValueRef::F64(_) => "a float",
        ValueRef::String(_) => "a string",
        ValueRef::Binary(_) => "bytes",
        ValueRef::Ext(..) => "an extension",
    }
}

// The text of a string (a key, a field's name).
fn text<'v>(value: &'v ValueRef<'_>) -> Option<&'v str> {
    match value {
        ValueRef::String(s) => s.as_str(),
        _ => None,
    }
}

// A key as the path names it.
fn key_name(key: &ValueRef<'_>) -> String {
    text(key).map_or_else(|| format!("{key}"), str::to_string)
}

/// The tensor `value` is (a map of exactly `bytes`, `shape` and `dtype`, as Burn writes its
/// `TensorData`), checked; `None` when it is no tensor.
fn tensor<'a>(value: &ValueRef<'a>, path: &[String]) -> Result<Option<Tensor<'a>>, String> {
    let ValueRef::Map(entries) = value else {
        return Ok(None);
    };
    let field = |name: &str| {
        entries
            .iter()
            .find(|(key, _)| text(key) == Some(name))
            .map(|(_, value)| value)
    };
    let (Some(data), Some(shape), Some(dtype), 3) = (
        field("bytes"),
        field("shape"),
        field("dtype"),
        entries.len(),
    ) else {
        return Ok(None);
    };
    let path = path.join(".");
    let ValueRef::Binary(data) = *data else {
        return Err(format!(
            "tensor `{path}` holds its values as {}, not as bytes (as Burn writes them)",
            kind(data)
        ));
    };
    let shape = match shape {
        ValueRef::Array(dims) => dims
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<Vec<usize>>>(),
        _ => None,
    }
    .ok_or_else(|| format!("tensor `{path}` has a shape that is not a list of dimensions"))?;
    // Read as Burn reads it (rmp-serde's enums: a name, or a variant's map).
    let mut encoded = Vec::new();
    write_value(&mut encoded, dtype)?;
    let dtype: DType = rmp_serde::from_slice(&encoded)
        .map_err(|e| format!("tensor `{path}` has no dtype of Burn's: {e}"))?;
    if matches!(dtype, DType::QFloat(_)) {
        return Err(format!(
            "tensor `{path}` is quantized ({dtype:?}), whose blocks cannot be cut by values"
        ));
    }
    let needs = count(&shape).ok().and_then(|n| n.checked_mul(dtype.size()));
    if needs != Some(data.len()) {
        return Err(format!(
            "tensor `{path}` has shape {shape:?} of {dtype:?} and holds {} bytes",
            data.len()
        ));
    }
    Ok(Some(Tensor { data, shape, dtype }))
}

// Writes the tensor map `entries` with its bytes and shape replaced, its other fields kept.
fn write_tensor(
    out: &mut Vec<u8>,
    entries: &[(ValueRef<'_>, ValueRef<'_>)],
    replacement: Replacement<'_>,
) -> Result<(), String> {
    rmp::encode::write_map_len(out, entries.len() as u32).map_err(encoding)?;
    for (key, value) in entries {
        write_value(out, key)?;
        match text(key) {
            Some("bytes") => {
                let len =
                    replacement.pieces.iter().map(|p| p.len()).sum::<usize>() + replacement.zeros;
                let len = u32::try_from(len).map_err(|_| {
                    format!("a tensor of {len} bytes is more than MessagePack holds (4 GiB)")
                })?;
                rmp::encode::write_bin_len(out, len).map_err(encoding)?;
                for piece in &replacement.pieces {
                    out.extend_from_slice(piece);
                }
                out.resize(out.len() + replacement.zeros, 0);
            }
            Some("shape") => {
                rmp::encode::write_array_len(out, replacement.shape.len() as u32)
                    .map_err(encoding)?;
                for &d in &replacement.shape {
                    rmp::encode::write_uint(out, d as u64).map_err(encoding)?;
                }
            }
            _ => write_value(out, value)?,
        }
    }
    Ok(())
}

fn write_value(out: &mut Vec<u8>, value: &ValueRef<'_>) -> Result<(), String> {
    rmpv::encode::write_value_ref(out, value).map_err(encoding)
}

// Writing into memory fails only on a length MessagePack cannot hold.
fn encoding(e: impl std::fmt::Display) -> String {
    format!("cannot write the state: {e}")
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rmpv::Value;

    use super::*;

    /// A tensor as Burn's `TensorData` encodes in `NamedMpk`.
    fn tensor_value(shape: &[usize], data: Vec<u8>, dtype: &str) -> Value {
        Value::Map(vec![
            ("bytes".into(), Value::Binary(data)),
            (
                "shape".into(),
                Value::Array(shape.iter().map(|&d| Value::from(d as u64)).collect()),
            ),
            ("dtype".into(), dtype.into()),
        ])
    }

    /// A record of one parameter's state laid out as Burn's Adam writes one (a version, a
    /// rank, a counter, two tensors of the parameter's shape and an absent one), with a
    /// tensor of another shape beside them.
    fn state_record(shape: &[usize], dtype: &str, first: Vec<u8>, second: Vec<u8>) -> Vec<u8> {
        let other_shape = vec![2; shape.len() + 1];
        let other = vec![7u8; 2 << shape.len()];
        let state = Value::Map(vec![
            ("time".into(), Value::from(3)),
            ("moment_1".into(), tensor_value(shape, first, dtype)),
            ("moment_2".into(), tensor_value(shape, second, dtype)),
            ("max_moment_2".into(), Value::Nil),
            ("other".into(), tensor_value(&other_shape, other, "U8")),
        ]);
        let rank = format!("Rank{}", shape.len());
        let record = Value::Map(vec![
            (
                "metadata".into(),
                Value::Map(vec![("version".into(), "0.21.0".into())]),
            ),
            (
                "item".into(),
                Value::Map(vec![("V1".into(), Value::Map(vec![(rank.into(), state)]))]),
            ),
            ("_b".into(), Value::Array(vec![])),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &record).unwrap();
        bytes
    }

    fn decode(bytes: &[u8]) -> Value {
        rmpv::decode::read_value(&mut &bytes[..]).unwrap()
    }

    /// The `bytes`, `shape` and `dtype` of a tensor's map.
    fn tensor_fields(entries: &[(Value, Value)]) -> Option<(&[u8], Vec<usize>, &Value)> {
        let field = |name: &str| entries.iter().find(|(k, _)| k.as_str() == Some(name));
        let (Some((_, Value::Binary(data))), Some((_, Value::Array(dims))), Some((_, dtype))) =
            (field("bytes"), field("shape"), field("dtype"))
        else {
            return None;
        };
        let dims = dims.iter().map(|d| d.as_u64().unwrap() as usize).collect();
        Some((data, dims, dtype))
    }

    /// Asserts that `slice` is `whole` with every tensor of shape `shape` holding exactly the
    /// values of process `rank`'s [`slice_range`] then zeros to [`slice_len`], shaped
    /// `[1, .., 1, len]`, and every other value as it was; the number of tensors cut.
    fn assert_slice_of(
        whole: &Value,
        slice: &Value,
        shape: &[usize],
        processes: usize,
        rank: usize,
    ) -> usize {
        match (whole, slice) {
            (Value::Map(w), Value::Map(s)) => {
                if let Some((data, dims, dtype)) = tensor_fields(w)
                    && dims == shape
                {
                    let (sliced, sliced_dims, sliced_dtype) =
                        tensor_fields(s).expect("a tensor where the whole state has one");
                    let values: usize = shape.iter().product();
                    let size = data.len().checked_div(values).unwrap_or(0);
                    let (len, range) = (
                        slice_len(values, processes),
                        slice_range(values, processes, rank),
                    );
                    let mut expected = data[range.start * size..range.end * size].to_vec();
                    expected.resize(len * size, 0);
                    let mut expected_dims = vec![1; shape.len()];
                    *expected_dims.last_mut().unwrap() = len;
                    assert_eq!(sliced_dims, expected_dims);
                    assert_eq!(sliced_dtype, dtype);
                    assert_eq!(sliced, expected.as_slice(), "process {rank} of {processes}");
                    return 1;
                }
                assert_eq!(w.len(), s.len());
                w.iter()
                    .zip(s)
                    .map(|((wk, wv), (sk, sv))| {
                        assert_eq!(wk, sk);
                        assert_slice_of(wv, sv, shape, processes, rank)
                    })
                    .sum()
            }
            (Value::Array(w), Value::Array(s)) => {
                assert_eq!(w.len(), s.len());
                w.iter()
                    .zip(s)
                    .map(|(w, s)| assert_slice_of(w, s, shape, processes, rank))
                    .sum()
            }
            _ => {
                assert_eq!(whole, slice);
                0
            }
        }
    }

    /// Asserts that cutting `whole` (one parameter's state of shape `shape`) for every process
    /// gives each its slices of the `tensors` tensors of the parameter's shape, and that joining
    /// them gives `whole` back, bit for bit.
    fn assert_slices_join(whole: &[u8], shape: &[usize], processes: usize, tensors: usize) {
        let parts: Vec<Vec<u8>> = (0..processes)
            .map(|rank| slice_state(whole, shape, processes, rank).unwrap())
            .collect();
        for (rank, part) in parts.iter().enumerate() {
            let cut = assert_slice_of(&decode(whole), &decode(part), shape, processes, rank);
            assert_eq!(cut, tensors, "tensors cut for process {rank}");
        }
        assert!(join_state(&parts, shape).unwrap() == whole);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn slicing_for_every_process_then_joining_is_the_state(
            shape in prop::collection::vec(0usize..6, 1..4),
            processes in 1usize..7,
            (dtype, size) in prop::sample::select(vec![
                ("F32", 4usize), ("F64", 8), ("BF16", 2), ("I64", 8), ("U8", 1),
            ]),
            seed in any::<u64>(),
        ) {
            let values: usize = shape.iter().product();
            let data = |salt: u64| -> Vec<u8> {
                (0..values * size)
                    .map(|i| (seed.wrapping_mul(i as u64 + salt) >> 7) as u8 | 1)
                    .collect()
            };
            let whole = state_record(&shape, dtype, data(1), data(2));
            assert_slices_join(&whole, &shape, processes, 2);
        }
    }

    #[test]
    fn a_parameter_of_fewer_values_than_processes_pads_every_slice() {
        let whole = state_record(&[2], "F32", vec![1; 8], vec![2; 8]);
        assert_slices_join(&whole, &[2], 3, 2);
        let last = decode(&slice_state(&whole, &[2], 3, 2).unwrap());
        let moment = &last["item"]["V1"]["Rank1"]["moment_1"];
        assert_eq!(moment["bytes"], Value::Binary(vec![0; 4]), "padding only");
    }

    #[test]
    fn bytes_that_are_not_one_messagepack_value_are_refused() {
        let whole = state_record(&[3, 5], "F32", vec![1; 60], vec![2; 60]);
        let err = slice_state(&whole[..whole.len() - 3], &[3, 5], 2, 0).unwrap_err();
        assert!(err.contains("not MessagePack"), "{err}");
        let err = slice_state(b"not MessagePack", &[3, 5], 2, 0).unwrap_err();
        assert!(err.contains("14 bytes follow it"), "{err}");
        let part = slice_state(&whole, &[3, 5], 2, 0).unwrap();
        let err = join_state(&[part, vec![0xdd, 0, 0]], &[3, 5]).unwrap_err();
        assert!(
            err.starts_with("process 1's state is not MessagePack"),
            "{err}"
        );
        let deep = [vec![0x91; 100], vec![0xc0]].concat();
        let err = slice_state(&deep, &[3, 5], 2, 0).unwrap_err();
        assert!(err.contains("not MessagePack"), "{err}");
    }

    #[test]
    fn a_tensor_whose_bytes_its_shape_does_not_fill_is_refused() {
        let whole = state_record(&[3, 5], "F32", vec![1; 59], vec![2; 60]);
        let err = slice_state(&whole, &[3, 5], 2, 0).unwrap_err();
        assert!(
            err.contains("`item.V1.Rank2.moment_1` has shape [3, 5] of F32 and holds 59 bytes"),
            "{err}"
        );
    }

    #[test]
    fn a_state_of_another_shape_is_refused() {
        let whole = state_record(&[3, 5], "F32", vec![1; 60], vec![2; 60]);
        let err = slice_state(&whole, &[5, 3], 2, 0).unwrap_err();
        assert!(
            err.contains("no tensor of the state has the parameter's shape [5, 3]"),
            "{err}"
        );
        let err = slice_state(&whole, &[3, 5], 2, 2).unwrap_err();
        assert!(err.contains("ranks 0..2"), "{err}");
    }

    #[test]
    fn parts_of_another_number_of_processes_or_structure_are_refused() {
        let whole = state_record(&[3, 5], "F32", vec![1; 60], vec![2; 60]);
        let slices = |processes| -> Vec<Vec<u8>> {
            (0..processes)
                .map(|rank| slice_state(&whole, &[3, 5], processes, rank).unwrap())
                .collect()
        };
        let err = join_state(&slices(3)[..2], &[3, 5]).unwrap_err();
        assert!(
            err.contains("no tensor of the state has the slice's shape [1, 8]")
                && err.contains("`item.V1.Rank2.moment_1` has shape [1, 5]")
                && err.contains("another number of processes"),
            "{err}"
        );
        let (two, three) = (slices(2), slices(3));
        let err = join_state(&[two[0].clone(), three[1].clone()], &[3, 5]).unwrap_err();
        assert!(
            err.contains(
                "tensor `item.V1.Rank2.moment_1` is F32 of shape [1, 8] in process 0's state \
                 and F32 of shape [1, 5] in process 1's"
            ),
            "{err}"
        );
        let vector = state_record(&[7], "F32", vec![1; 28], vec![2; 28]);
        let other = slice_state(&vector, &[7], 2, 1).unwrap();
        let err = join_state(&[two[0].clone(), other], &[3, 5]).unwrap_err();
        assert!(
            err.contains(
                "process 1's state differs from process 0's at `item.V1`: key `Rank1` where \
                 process 0's has `Rank2`"
            ),
            "{err}"
        );
        assert!(join_state(&[], &[3, 5]).is_err());
    }

    #[test]
    fn values_other_than_tensors_are_process_0_s() {
        let whole = state_record(&[7], "F32", vec![1; 28], vec![2; 28]);
        let mut parts: Vec<Vec<u8>> = (0..2)
            .map(|rank| slice_state(&whole, &[7], 2, rank).unwrap())
            .collect();
        // Process 1's counter is another (`"time": 9`): the joined one is process 0's.
        let time = [0xa4, b't', b'i', b'm', b'e', 3];
        let at = parts[1].windows(6).position(|w| w == time).unwrap();
        parts[1][at + 5] = 9;
        assert!(join_state(&parts, &[7]).unwrap() == whole);
    }

    /// Real optimizer records, on every backend the build has.
    #[cfg(any(feature = "flex", feature = "ndarray"))]
    mod records {
        use burn::module::{Module, Param, ParamId};
        use burn::optim::{
            AdamConfig, GradientsParams, Optimizer, SgdConfig, momentum::MomentumConfig,
        };
        use burn::record::{Record, Recorder};
        use burn::tensor::backend::AutodiffBackend;
        use burn::tensor::{Tensor, TensorData};
        use hashbrown::HashMap;

        use super::*;
        use crate::record_bytes::Bytes;
        use crate::zero::ParamStateRecord;

        /// Parameters whose values divide by no process count but 1 (15 and 7), and one of
        /// fewer values than some processes (2).
        #[derive(Module, Debug)]
        struct Net<B: burn::tensor::backend::Backend> {
            matrix: Param<Tensor<B, 2>>,
            vector: Param<Tensor<B, 1>>,
            pair: Param<Tensor<B, 1>>,
        }

        fn net<B: AutodiffBackend>() -> Net<B> {
            let device = Default::default();
            let values = |n: usize| (0..n).map(|i| i as f32 * 0.37 - 1.3).collect::<Vec<_>>();
            Net {
                matrix: Param::from_data(TensorData::new(values(15), [3, 5]), &device),
                vector: Param::from_data(TensorData::new(values(7), [7]), &device),
                pair: Param::from_data(TensorData::new(values(2), [2]), &device),
            }
        }

        /// The record of `optimizer` after two steps (non-zero moments, a counter of 2), and
        /// the shapes of the parameters by id.
        fn trained<B: AutodiffBackend, O: Optimizer<Net<B>, B>>(
            mut optimizer: O,
        ) -> (O::Record, HashMap<ParamId, Vec<usize>>) {
            let mut model = net::<B>();
            for _ in 0..2 {
                let loss = (model.matrix.val() * model.matrix.val()).sum()
                    + model.vector.val().sin().sum()
                    + (model.pair.val() * model.pair.val() * model.pair.val()).sum();
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optimizer.step(1e-2, model, grads);
            }
            let shapes = HashMap::from([
                (model.matrix.id, vec![3, 5]),
                (model.vector.id, vec![7]),
                (model.pair.id, vec![2]),
            ]);
            (optimizer.to_record(), shapes)
        }

        /// Each state of `record` on its own, as `Bytes` encodes it.
        fn encoded<B: AutodiffBackend, S: Record<B>>(
            record: HashMap<ParamId, S>,
        ) -> HashMap<ParamId, Vec<u8>> {
            record
                .into_iter()
                .map(|(id, state)| {
                    (
                        id,
                        Recorder::<B>::record(&Bytes::default(), state, ()).unwrap(),
                    )
                })
                .collect()
        }

        /// Asserts that slicing the record `record()` makes for every one of `processes`
        /// processes holds its slices of every state, and that joining them gives the
        /// record back bit for bit (tensors and counters).
        fn assert_record_slices_join<B: AutodiffBackend, S: Record<B>>(
            record: impl Fn() -> HashMap<ParamId, S>,
            shapes: &HashMap<ParamId, Vec<usize>>,
            processes: usize,
            tensors: usize,
        ) {
            let device = Default::default();
            let shape_of = |id: ParamId| shapes.get(&id).cloned();
            let whole = encoded::<B, _>(record());
            assert_eq!(whole.len(), 3);
            for bytes in whole.values() {
                // Moments still zero would pass anything.
                assert!(
                    decode_tensors(bytes)
                        .iter()
                        .all(|data| data.iter().any(|&b| b != 0))
                );
            }
            let parts: Vec<HashMap<ParamId, S>> = (0..processes)
                .map(|rank| record().slice(&shape_of, processes, rank, &device).unwrap())
                .collect();
            let parts: Vec<HashMap<ParamId, Vec<u8>>> =
                parts.into_iter().map(encoded::<B, _>).collect();
            for (rank, part) in parts.iter().enumerate() {
                for (id, bytes) in part {
                    let cut = assert_slice_of(
                        &decode(&whole[id]),
                        &decode(bytes),
                        &shapes[id],
                        processes,
                        rank,
                    );
                    assert_eq!(cut, tensors);
                }
            }
            let parts: Vec<HashMap<ParamId, S>> = (0..processes)
                .map(|rank| record().slice(&shape_of, processes, rank, &device).unwrap())
                .collect();
            let joined = HashMap::join(parts, &shape_of, &device).unwrap();
            assert!(
                encoded::<B, _>(joined) == whole,
                "over {processes} processes"
            );
        }

        /// The values of every tensor in a state's bytes.
        fn decode_tensors(bytes: &[u8]) -> Vec<Vec<u8>> {
            fn walk(value: &Value, found: &mut Vec<Vec<u8>>) {
                match value {
                    Value::Map(entries) => match tensor_fields(entries) {
                        Some((data, _, _)) => found.push(data.to_vec()),
                        None => entries.iter().for_each(|(_, v)| walk(v, found)),
                    },
                    Value::Array(items) => items.iter().for_each(|v| walk(v, found)),
                    _ => {}
                }
            }
            let mut found = Vec::new();
            walk(&decode(bytes), &mut found);
            found
        }

        fn adam_and_sgd_states_slice_and_join_on<B: AutodiffBackend>() {
            let (_, shapes) = trained::<B, _>(AdamConfig::new().init::<B, Net<B>>());
            for processes in [1, 2, 3, 4] {
                // Every record of a test is its optimizer's after the same steps from the same
                // start (ids aside, which are drawn again: each record keys by its own model's).
                let adam = || {
                    let (record, ids) = trained::<B, _>(AdamConfig::new().init::<B, Net<B>>());
                    rekey_as(record, &ids, &shapes)
                };
                assert_record_slices_join::<B, _>(adam, &shapes, processes, 2);
                let sgd = || {
                    let sgd = SgdConfig::new()
                        .with_momentum(Some(MomentumConfig::new()))
                        .init::<B, Net<B>>();
                    let (record, ids) = trained::<B, _>(sgd);
                    rekey_as(record, &ids, &shapes)
                };
                assert_record_slices_join::<B, _>(sgd, &shapes, processes, 1);
            }
        }

        /// `record`, keyed by `ids`, keyed by the ids of the same shapes in `shapes`.
        fn rekey_as<S>(
            record: HashMap<ParamId, S>,
            ids: &HashMap<ParamId, Vec<usize>>,
            shapes: &HashMap<ParamId, Vec<usize>>,
        ) -> HashMap<ParamId, S> {
            let by_shape: HashMap<&Vec<usize>, ParamId> =
                shapes.iter().map(|(id, shape)| (shape, *id)).collect();
            record
                .into_iter()
                .map(|(id, state)| (by_shape[&ids[&id]], state))
                .collect()
        }

        fn a_state_one_part_lacks_is_refused_on<B: AutodiffBackend>() {
            let device = Default::default();
            // Keyed by place, as the processes' parts travel: the error names the place.
            let shapes: HashMap<ParamId, Vec<usize>> = [vec![3, 5], vec![7], vec![2]]
                .into_iter()
                .zip(0u64..)
                .map(|(shape, place)| (ParamId::from(place), shape))
                .collect();
            let shape_of = |id: ParamId| shapes.get(&id).cloned();
            let parts = || -> Vec<HashMap<ParamId, _>> {
                (0..2)
                    .map(|rank| {
                        let (record, ids) = trained::<B, _>(AdamConfig::new().init::<B, Net<B>>());
                        let record = rekey_as(record, &ids, &shapes);
                        record.slice(&shape_of, 2, rank, &device).unwrap()
                    })
                    .collect()
            };
            let mut missing = parts();
            missing[1].remove(&ParamId::from(1));
            let Err(err) = HashMap::join(missing, &shape_of, &device) else {
                panic!("joined without a state");
            };
            assert_eq!(
                err,
                "process 1's optimizer state holds none of parameter #1, and process 0's does"
            );
            let mut extra = parts();
            extra[0].remove(&ParamId::from(2));
            let Err(err) = HashMap::join(extra, &shape_of, &device) else {
                panic!("joined without a state");
            };
            assert_eq!(
                err,
                "process 1's optimizer state holds parameter #2's, and process 0's does not"
            );
        }

        /// Runs the generic check `$check` on every backend this build has.
        macro_rules! on_every_backend {
            ($check:ident) => {{
                #[cfg(feature = "flex")]
                $check::<burn::backend::Autodiff<burn::backend::Flex>>();
                #[cfg(feature = "ndarray")]
                $check::<burn::backend::Autodiff<burn::backend::NdArray>>();
            }};
        }

        #[test]
        fn adam_and_sgd_states_slice_and_join() {
            on_every_backend!(adam_and_sgd_states_slice_and_join_on);
        }

        #[test]
        fn a_state_one_part_lacks_is_refused() {
            on_every_backend!(a_state_one_part_lacks_is_refused_on);
        }
    }
}
