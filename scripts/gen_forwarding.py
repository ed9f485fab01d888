#!/usr/bin/env python3
"""Generates the decorator's forwarding impls from Burn's own trait definitions.

Every method of every ops trait, defaulted ones included, becomes a one-line call to the
inner backend. Methods named in the autocast op table (`src/op_table.rs`, the
`autocast_ops!` list) first pass their tensor arguments through the co-locate rule (off by
default, see `src/backend/placement.rs`) and their float-tensor arguments through a cast plan;
required ones are numbered (`cast_at`), since fp8 autocast scales each input of a call
separately. The device moves named in `MOVE_HOOKS` go to hand-written functions in
`src/backend/placement.rs` (host-staged moves where the inner backend has no direct copy);
the ops named in `LOW_PATHS`, `FUSED_PATHS` and `HALF_PATHS` go to `src/backend/lowered.rs`
and `src/backend/kernels.rs`, where the crate's own CPU kernels (`src/cpu/`) take them where
they apply.

Usage: python3 scripts/gen_forwarding.py [path/to/burn-backend-0.21.0]
"""
import glob
import os
import re
import subprocess
import sys

TRAITS = [
    # (source file under src/backend/ops, trait, generated file)
    ("tensor.rs", "FloatTensorOps", "float.rs"),
    ("int_tensor.rs", "IntTensorOps", "int.rs"),
    ("bool_tensor.rs", "BoolTensorOps", "bool.rs"),
    ("modules/base.rs", "ModuleOps", "module.rs"),
    ("activation.rs", "ActivationOps", "activation.rs"),
    ("qtensor.rs", "QTensorOps", "quantized.rs"),
    ("transaction.rs", "TransactionOps", "transaction.rs"),
]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT_DIR = os.path.join(ROOT, "src", "backend", "forward")
OPS_TABLE = os.path.join(ROOT, "src", "op_table.rs")


def burn_backend_dir():
    if len(sys.argv) > 1:
        return sys.argv[1]
    found = glob.glob(os.path.expanduser("~/.cargo/registry/src/*/burn-backend-0.21.0"))
    if not found:
        sys.exit("burn-backend-0.21.0 not found: run `cargo fetch` first")
    return found[0]


def strip_comments(src):
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    return "\n".join(re.sub(r"//.*$", "", line) for line in src.splitlines())


def trait_body(src, trait):
    m = re.search(r"pub trait %s<B: Backend>\s*\{" % trait, src)
    if not m:
        sys.exit("trait %s not found" % trait)
    i, depth = m.end(), 1
    start = i
    while depth:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        i += 1
    return src[start : i - 1]


def methods(body):
    """Yields (name, generics, params, ret, where) for every `fn` at the trait's top level."""
    i, depth = 0, 0
    while i < len(body):
        c = body[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif depth == 0 and body.startswith("fn ", i) and (i == 0 or not body[i - 1].isalnum()):
            j, paren, angle = i, 0, 0
            while True:
                ch = body[j]
                if ch == "(":
                    paren += 1
                elif ch == ")":
                    paren -= 1
                elif ch == "<":
                    angle += 1
                elif ch == ">" and body[j - 1] != "-":
                    angle -= 1
                elif ch in "{;" and paren == 0 and angle == 0:
                    break
                j += 1
            yield parse_sig(" ".join(body[i:j].split()))
            i = j
            continue
        i += 1


def split_top(s, sep=","):
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "(<[":
            depth += 1
        elif ch in ")]" or (ch == ">" and not cur.endswith("-")):
            depth -= 1
        if ch == sep and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def parse_sig(sig):
    m = re.match(r"fn (\w+)\s*(<.*?>)?\s*\((.*)$", sig)
    name, generics, rest = m.group(1), m.group(2) or "", m.group(3)
    depth, k = 1, 0
    while depth:
        depth += {"(": 1, ")": -1}.get(rest[k], 0)
        k += 1
    params, tail = rest[: k - 1], rest[k:].strip()
    where = ""
    if " where " in " " + tail:
        tail, where = re.split(r"\bwhere\b", tail, maxsplit=1)
        where = "where " + where.strip()
    ret = tail.strip()
    parsed = []
    for p in split_top(params):
        pat, ty = p.split(":", 1)
        parsed.append((pat.replace("mut ", "").strip(), ty.strip()))
    return name, generics, parsed, ret, where


def to_self(s):
    # Types are written for the trait's `B`; in the impl they are `Self`'s, and paths into the
    # trait's own crate are paths into burn_backend.
    return re.sub(r"\bB\b", "Self", s).replace("crate::", "burn_backend::")


def autocast_table():
    """Method name -> `Op` variant, read from the one op table."""
    src = open(OPS_TABLE).read()
    block = re.search(r"autocast_ops!\s*\{(.*?)\n\}", src, re.S).group(1)
    return dict((m, v) for v, m in re.findall(r"^\s*(\w+)\s*=\s*(\w+)\s*=>", block, re.M))


# Backend-generic structs: nominally different types for `B` and `Accelerated<B>`.
REWRAP = re.compile(r"^(TransactionPrimitive|QuantizationParametersPrimitive|DeformConv2dBackward|"
                    r"MaxPool[12]dWithIndices|MaxPool[12]dBackward|TensorPrimitive)<B>$")

# Device moves routed through hand-written functions of `crate::backend::placement`.
MOVE_HOOKS = {"float_to_device", "int_to_device", "bool_to_device"}

# Lower-class ops whose autocast call goes through a function of `crate::backend` (the
# crate's own kernel where it applies, see src/backend/lowered.rs), as "module::function".
LOW_PATHS = {
    "float_matmul": "lowered::matmul",
    "linear": "lowered::linear",
    "conv1d": "lowered::conv1d",
    "conv2d": "lowered::conv2d",
}

# Op-table ops whose call, once the plan has cast the inputs, goes through a function of
# `crate::backend` with the same arguments (the crate's own kernel where the backend has one
# and it applies, see src/backend/kernels.rs: softmax's under autocast; the elementwise
# arithmetic's, given the promoted operands, with or without), as "module::function".
FUSED_PATHS = {
    "float_add": "kernels::add",
    "float_sub": "kernels::sub",
    "float_mul": "kernels::mul",
    "float_div": "kernels::div",
}

# Op-table ops whose call goes through a function of `crate::backend` with the plan and the
# inputs as given, which casts them itself: softmax's widens a half input inside its own
# kernel, where the plan would have cast it to f32 first (the same bits, one pass fewer over
# attention's largest tensor), as "module::function".
CASTING_PATHS = {
    "softmax": "kernels::softmax",
    "log_softmax": "kernels::log_softmax",
}

# Ops outside the op table forwarded through a function of `crate::backend` (the crate's own
# kernel where the backend has one and it applies, see src/backend/kernels.rs), as
# "module::function".
HALF_PATHS = {
    "relu": "kernels::relu",
    "gelu": "kernels::gelu",
    "float_random": "kernels::random",
    "float_mask_fill": "kernels::mask_fill",
    "float_reshape": "kernels::reshape",
    "float_add_scalar": "kernels::add_scalar",
    "float_sub_scalar": "kernels::sub_scalar",
    "float_mul_scalar": "kernels::mul_scalar",
    "float_div_scalar": "kernels::div_scalar",
}

# How the co-locate rule moves each kind of tensor argument of a table op.
COLOCATE = {
    "FloatTensor<B>": "colocate.float(%s)",
    "Option<FloatTensor<B>>": "colocate.float_opt(%s)",
    "Vec<FloatTensor<B>>": "colocate.float_vec(%s)",
    "IntTensor<B>": "colocate.int(%s)",
    "Option<IntTensor<B>>": "colocate.int_opt(%s)",
    "BoolTensor<B>": "colocate.bool(%s)",
    "Option<BoolTensor<B>>": "colocate.bool_opt(%s)",
}

FLOAT = re.compile(r"^(FloatTensor<B>|Option<FloatTensor<B>>|Vec<FloatTensor<B>>)$")

# ZeRO stage 3's placeholders (src/backend/placeholder.rs): every float tensor an op takes
# is resolved first (a registered parameter gathered whole, any other tensor as it is), so
# that no op reads a placeholder's zeros; the ops named in BOUNDED first try their own path,
# which gathers the parameter for the op alone.
RESOLVE = {
    "FloatTensor<B>": "let %s = crate::backend::placeholder::resolve::<B>(%s);",
    "Option<FloatTensor<B>>": "let %s = crate::backend::placeholder::resolve_opt::<B>(%s);",
    "Vec<FloatTensor<B>>": "let %s = crate::backend::placeholder::resolve_vec::<B>(%s);",
    "TransactionPrimitive<B>": (
        "let mut %s = %s; %s.read_floats = "
        "crate::backend::placeholder::resolve_vec::<B>(core::mem::take(&mut %s.read_floats));"
    ),
}

# Ops with a bounded path in src/backend/placeholder.rs (and its modules), taking and giving back the op's
# arguments (in signature order) where the path does not apply.
BOUNDED = {"linear", "embedding", "float_matmul", "layer_norm"}
# The convolutions' (src/backend/placeholder/conv.rs).
# Reshaped parameters and their products (src/backend/placeholder/view.rs).
BOUNDED |= {"float_reshape", "float_mul"}
BOUNDED |= {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}

# Reads that build no autodiff graph: a registered parameter is gathered without the anchor
# node that ops read it through (`resolve_read`).
READS = {"float_into_data"}

# Ops that read no value of a tracked leaf they keep as it is: the resolve is skipped there,
# so that a registered parameter stays itself (the same autodiff node, still registered).
# Burn's `Param` load (`Learner::load_model`, ZeRO stage 3 under `with_accelerate`) sets
# `require_grad` on every parameter it loads; on a tracked leaf Burn's autodiff returns it.
KEEPS_TRACKED_LEAF = {
    "float_set_require_grad": (
        "        let tensor = if _require_grad && B::float_is_require_grad(&tensor) {\n"
        "            tensor\n"
        "        } else {\n"
        "            crate::backend::placeholder::resolve::<B>(tensor)\n"
        "        };\n"
    ),
}


def resolves(name, params):
    """The lines that resolve an op's placeholders before anything else reads its inputs."""
    lines = []
    if name in KEEPS_TRACKED_LEAF:
        return KEEPS_TRACKED_LEAF[name]
    if name in BOUNDED:
        names = ", ".join(p for p, _ in params)
        lines.append(
            "        let (%s) = match crate::backend::placeholder::%s::<B>(%s) {\n"
            "            Ok(output) => return output,\n"
            "            Err(inputs) => inputs,\n"
            "        };\n" % (names, name, names)
        )
    for p, t in params:
        if t in RESOLVE:
            line = RESOLVE[t]
            if name in READS:
                line = line.replace("placeholder::resolve::", "placeholder::resolve_read::")
            lines.append("        %s\n" % (line % ((p,) * line.count("%s"))))
    return "".join(lines)


def emit(name, generics, params, ret, where, op):
    sig_params = ", ".join("%s: %s" % (p, to_self(t)) for p, t in params)
    ret_s = (" " + to_self(ret)) if ret else ""
    where_s = (" " + to_self(where)) if where else ""
    turbofish = ""
    if generics:
        names = [g.split(":")[0].strip() for g in split_top(generics[1:-1])]
        names = [n for n in names if not n.startswith("'")]
        if names:
            turbofish = "::<%s>" % ", ".join(names)
    args = ", ".join(("%s.rewrap()" % p) if REWRAP.match(t) else p for p, t in params)
    head = "    fn %s%s(%s)%s%s {\n" % (name, generics, sig_params, ret_s, where_s)
    head += resolves(name, params)
    call = "B::%s%s(%s)" % (name, turbofish, args)
    if REWRAP.match(ret.replace("-> ", "").strip()):
        call = "%s.rewrap()" % call
    if name in MOVE_HOOKS:
        if op is not None:
            sys.exit("%s is both a move hook and in the op table" % name)
        hook = "placement::%s::<B>(%s)" % (name, args)
        return head + "        %s\n    }\n" % hook
    if op is None:
        if name in HALF_PATHS:
            call = "crate::backend::%s::<B>(%s)" % (HALF_PATHS[name], args)
        return head + "        %s\n    }\n" % call
    floats = [(p, t) for p, t in params if FLOAT.match(t)]
    if not floats:
        sys.exit("op table names %s, which takes no float tensor" % name)
    inputs = ", ".join(
        {
            "FloatTensor<B>": "CastInput::One(&%s)",
            "Option<FloatTensor<B>>": "CastInput::Maybe(&%s)",
            "Vec<FloatTensor<B>>": "CastInput::Many(&%s)",
        }[t] % p
        for p, t in floats
    )
    lines = []
    tensors = [(p, t) for p, t in params if t in COLOCATE]
    # An op with one tensor argument has nothing to co-locate it with.
    if len(tensors) > 1 or any(t.startswith("Vec<") for _, t in tensors):
        lines.append("        let colocate = Colocate::<B>::new(&[%s]);\n" % inputs)
        for p, t in tensors:
            lines.append("        let %s = %s;\n" % (p, COLOCATE[t] % p))
    lines.append("        let plan = CastPlan::new::<B>(Op::%s, &[%s]);\n" % (op, inputs))
    if name in CASTING_PATHS:
        call = "crate::backend::%s::<B>(&plan, %s)" % (CASTING_PATHS[name], args)
        return head + "".join(lines) + "        %s\n    }\n" % call
    # Required inputs are numbered (fp8 keeps a scale per input); optional ones are not rounded.
    required = 0
    for p, t in floats:
        if t == "FloatTensor<B>":
            lines.append("        let %s = plan.cast_at::<B>(%d, %s);\n" % (p, required, p))
            required += 1
        else:
            method = {"Option<FloatTensor<B>>": "cast_opt", "Vec<FloatTensor<B>>": "cast_vec"}[t]
            lines.append("        let %s = plan.%s::<B>(%s);\n" % (p, method, p))
    if name in LOW_PATHS:
        call = "crate::backend::%s::<B>(&plan, %s)" % (LOW_PATHS[name], args)
    elif name in FUSED_PATHS:
        call = "crate::backend::%s::<B>(%s)" % (FUSED_PATHS[name], args)
    return head + "".join(lines) + "        %s\n    }\n" % call


HEADER = """// @generated by scripts/gen_forwarding.py from burn-backend 0.21.0's `{trait}`.
// Do not edit by hand: change the op table in src/op_table.rs or the generator, then rerun it.
#![allow(unused_imports, clippy::too_many_arguments, clippy::type_complexity)]

use crate::autocast::{{CastInput, CastPlan, Op}};
use crate::backend::Accelerated;
use crate::backend::placement::{{self, Colocate}};
use crate::backend::rewrap::Rewrap;
use burn_backend::ops::*;
use burn_backend::quantization::*;
use burn_backend::tensor::Device;
use burn_backend::tensor::*;
use burn_backend::*;
use core::future::Future;
use core::ops::Range;

impl<B: Backend> {trait}<Self> for Accelerated<B> {{
"""


def main():
    base = os.path.join(burn_backend_dir(), "src", "backend", "ops")
    table = autocast_table()
    seen = set()
    every = set()
    hooked = set()
    os.makedirs(OUT_DIR, exist_ok=True)
    for src_file, trait, out in TRAITS:
        body = trait_body(strip_comments(open(os.path.join(base, src_file)).read()), trait)
        text = HEADER.format(trait=trait)
        for name, generics, params, ret, where in methods(body):
            op = table.get(name)
            every.add(name)
            if op:
                seen.add(name)
            if name in MOVE_HOOKS or name in HALF_PATHS:
                hooked.add(name)
            text += emit(name, generics, params, ret, where, op)
        text += "}\n"
        with open(os.path.join(OUT_DIR, out), "w") as f:
            f.write(text)
    # Format like the rest of the crate, so a rerun on an unchanged table changes nothing.
    subprocess.run(["rustfmt", "--edition", "2024"] + [os.path.join(OUT_DIR, out) for _, _, out in TRAITS], check=True)
    missing = set(table) - seen
    if set(HALF_PATHS) & set(table):
        sys.exit("half paths must name methods outside the op table: %s" % sorted(HALF_PATHS))
    if set(LOW_PATHS) - seen:
        sys.exit("low paths name ops outside the op table: %s" % sorted(set(LOW_PATHS) - seen))
    if set(FUSED_PATHS) - seen:
        sys.exit("fused paths name ops outside the op table: %s" % sorted(set(FUSED_PATHS) - seen))
    if set(CASTING_PATHS) - seen:
        sys.exit("casting paths name ops outside the op table: %s" % sorted(set(CASTING_PATHS) - seen))
    routed = [set(LOW_PATHS), set(FUSED_PATHS), set(CASTING_PATHS)]
    for i, a in enumerate(routed):
        for b in routed[i + 1:]:
            if a & b:
                sys.exit("an op has two routes: %s" % sorted(a & b))
    if BOUNDED - every:
        sys.exit("bounded paths name ops no ops trait has: %s" % sorted(BOUNDED - every))
    if READS - every:
        sys.exit("reads name ops no ops trait has: %s" % sorted(READS - every))
    missing_hooks = (MOVE_HOOKS | set(HALF_PATHS)) - hooked
    if missing_hooks:
        sys.exit("move hooks or half paths name methods Burn does not have: %s" % sorted(missing_hooks))
    if missing:
        sys.exit("op table names methods Burn does not have: %s" % sorted(missing))


if __name__ == "__main__":
    main()
