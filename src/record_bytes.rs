//! Burn's records as bytes and back (Burn's `NamedMpk` format, in full precision), without
//! Burn's panics: the bytes may come from a damaged file (a checkpoint) or another process (a
//! ZeRO run's optimizer state), so what is wrong with them is an error, not a panic.

use std::panic::AssertUnwindSafe;

use burn::record::{BurnRecord, FullPrecisionSettings, NamedMpkBytesRecorder, Record, Recorder};
use burn::tensor::backend::Backend;

/// The recorder of every record a checkpoint holds and a process sends.
pub(crate) type Bytes = NamedMpkBytesRecorder<FullPrecisionSettings>;

/// A record from its bytes ([`Bytes`]'s), on `device`; what is wrong with them otherwise.
///
/// Burn's recorder panics, rather than failing, on some bytes that decode (a parameter id
/// that is not one, a tensor whose data does not fill its shape): its `from_item` has no
/// error. The bytes are first decoded (serde's errors are Burn's), then the record is built
/// with the panic caught and turned into the reason, since the bytes may come from a damaged
/// file or another process.
pub(crate) fn from_bytes<B: Backend, R: Record<B>>(
    mut bytes: Vec<u8>,
    device: &B::Device,
) -> Result<R, String> {
    check_tensors(&bytes)?;
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
            format!("holds a value Burn cannot load ({what})")
        },
    )
}

/// Checks, before Burn builds a record, that each tensor in `bytes` (a map with `bytes`,
/// `shape` and `dtype`, Burn's `TensorData`) holds as many bytes as its shape says; Burn does
/// not (a record whose shape claims 2^40 rows over 48 bytes of data loads, a tensor whose
/// shape says nothing true about its data). The walk keeps nothing but the path to the tensor it is in.
///
/// It also refuses a record nested deeper than [`MAX_DEPTH`], before any recursive decoder
/// (this walk, or serde's skipping of a field) can overflow a thread's stack on it.
pub(crate) fn check_tensors(bytes: &[u8]) -> Result<(), String> {
    let mut path = Vec::new();
    let mut deserializer = rmp_serde::Deserializer::from_read_ref(bytes);
    deserializer.set_max_depth(MAX_DEPTH);
    serde::de::DeserializeSeed::deserialize(Walk { path: &mut path }, &mut deserializer)
        .map_err(|e| e.to_string())
}

/// The deepest nesting a record may have: Burn's records nest as deep as their modules, a
/// few levels (MessagePack's own limit, 1024, still overflows a test thread's 2 MiB stack in
/// a debug build).
const MAX_DEPTH: usize = 64;

/// The most dimensions a shape is read with (Burn's tensors have a handful).
const MAX_DIMS: usize = 64;

/// One value of the walk of [`check_tensors`].
struct Walk<'p> {
    path: &'p mut Vec<String>,
}

impl<'de> serde::de::DeserializeSeed<'de> for Walk<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

/// What a field of a map was, as far as the tensor check needs.
#[derive(Default)]
enum Seen {
    /// Anything else (walked).
    #[default]
    Other,
    /// A string (a key, or a dtype such as `"F32"`).
    Text(String),
    /// An unsigned number (a dimension of a shape).
    Number(u64),
    /// Bytes, or a sequence of this many elements, with its numbers when it holds only
    /// unsigned numbers, at most [`MAX_DIMS`] (a shape).
    Items(u64, Option<Vec<u64>>),
}

impl<'de> serde::de::Visitor<'de> for Walk<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a Burn record")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_bytes<E>(self, _: &[u8]) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq
            .next_element_seed(Walk {
                path: &mut *self.path,
            })?
            .is_some()
        {}
        Ok(())
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let (mut data, mut shape, mut dtype) = (None, None, None);
        while let Some(key) = map.next_key_seed(Look {
            path: &mut *self.path,
        })? {
            let Seen::Text(key) = key else {
                map.next_value_seed(Walk {
                    path: &mut *self.path,
                })?;
                continue;
            };
            self.path.push(key);
            let value = map.next_value_seed(Look {
                path: &mut *self.path,
            })?;
            let key = self.path.pop().unwrap_or_default();
            match (key.as_str(), value) {
                ("bytes", Seen::Items(len, _)) => data = Some(len),
                ("shape", Seen::Items(_, Some(dims))) => shape = Some(dims),
                ("dtype", Seen::Text(name)) => dtype = Some(name),
                _ => {}
            }
        }
        let (Some(len), Some(dims), Some(name)) = (data, shape, dtype) else {
            return Ok(());
        };
        // Quantized and boolean dtypes are maps, not names, and are not checked.
        let de = serde::de::value::StrDeserializer::<serde::de::value::Error>::new(&name);
        let Ok(dtype) = <burn::tensor::DType as serde::Deserialize>::deserialize(de) else {
            return Ok(());
        };
        let needs = dims
            .iter()
            .try_fold(dtype.size() as u64, |n, &d| n.checked_mul(d));
        if needs == Some(len) {
            return Ok(());
        }
        let needs = needs.map_or_else(|| "more than 2^64".to_string(), |n| n.to_string());
        Err(serde::de::Error::custom(format!(
            "tensor `{}` has shape {dims:?} of {name}, which needs {needs} bytes, and holds {len}",
            self.path.join(".")
        )))
    }
}

/// A value of a map, noted as [`Seen`] (walked when it is a map or holds one).
struct Look<'p> {
    path: &'p mut Vec<String>,
}

impl<'de> serde::de::DeserializeSeed<'de> for Look<'_> {
    type Value = Seen;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Seen, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Look<'_> {
    type Value = Seen;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a Burn record")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Seen, E> {
        Ok(Seen::Other)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Seen, E> {
        Ok(Seen::Other)
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
        Ok(Seen::Items(v.len() as u64, None))
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

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Seen, A::Error> {
        let (mut count, mut numbers) = (0u64, Some(Vec::new()));
        while let Some(item) = seq.next_element_seed(Look {
            path: &mut *self.path,
        })? {
            count += 1;
            match (item, numbers.as_mut()) {
                (Seen::Number(d), Some(dims)) if dims.len() < MAX_DIMS => dims.push(d),
                _ => numbers = None,
            }
        }
        Ok(Seen::Items(count, numbers))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Seen, A::Error> {
        Walk { path: self.path }.visit_map(map)?;
        Ok(Seen::Other)
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
