"""Synthetic GGUF models: real tensor names, metadata and tokenizer, random weights.

`write_synthetic_gguf(path, family, shape, qtype)` writes a file that the loader accepts as it
accepts a downloaded model, so tests and benchmarks can run any family, size and quant type without
the real weights. A family is its file `family/<family>.toml`, read through airframe.family: the
hyperparameter keys it writes (in the file's order, the shape's values, else the family's typical
values or defaults) and the tensors (with the shapes of `family.TENSOR_SHAPES`), so a new family
file is a new synthetic family. The weights are random with realistic scales (matrices
N(0, 0.02^2), norm weights near 1; Gemma stores norm weights as w + 1, so those are near 1 as
well). Each tensor's values are a pure function of (seed, tensor name), see `tensor_values`, so
tests can compare what was written with what was meant.

The tokenizer is SmolLM2's (GPT-2 byte-level BPE, ChatML template), copied from its GGUF; the
`tokenizer` argument names another model to copy from (e.g. "gemma3-270m": SentencePiece, 262,144
tokens). The tiny presets cut it to 512 tokens (special tokens, the byte alphabet, the first
merges). A smaller `vocab` keeps the first tokens and the merges whose two parts and result are all
kept; a larger one appends unused "[PAD<id>]" tokens (as llama.cpp's converter pads vocabularies).
So the `llama3.2-1b` shape has Llama 3.2 1B's sizes (vocab 128,256) but SmolLM2's tokenizer padded
with dummy tokens: the Llama 3 tokenizer's metadata is not available here. Its rope_freqs.weight
(Llama 3 RoPE scaling) is not written either.

Quant types: one GGML type for every 2-D matrix (norms stay F32), or a mix preset (`Q4_K_M`,
`Q5_K_M`). A matrix whose row length is not a multiple of the type's block falls back the way
llama.cpp's quantizer does: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and a 32-value type -> F16
(see `airframe.quants.compatible_type`).

`fast=True` generates one layer's weights and repeats them in every layer (file writing speed does
not depend on the values); the file's general.name says so.
"""

from __future__ import annotations

import math
import os
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType, TokenType
from tqdm import tqdm

from .errors import ParameterError
from .family import (CAP_HPARAMS, FLOAT_HPARAMS, INT_HPARAMS, Family, families_by_name, shape_of, size_of,
                     tensor_shapes)
from .gguf_file import GGUFFile
from .models import resolve_model
from .quantize import quantize
from .quants import compatible_type, quant, qtype_named
from .rope_scaling import RopeScaling, llama3_freq_factors

Q = GGMLQuantizationType
V = GGUFValueType

MATRIX_STD = 0.02
NORM_STD = 0.02
BIAS_STD = 0.5  # Qwen 2's Q/K biases are large next to the projections; a missing bias must show
TOKENIZER_SOURCE = "smollm2-135m"
_CHUNK_VALUES = 1 << 22  # values generated per random stream; fixed so values never depend on threads

# ---- shapes ----------------------------------------------------------------------------------
# Every preset gives the sizes, in the family files' hyperparameter names; the family's typical
# values and defaults fill what a preset leaves out, a dict passed as `shape` overrides both. A
# preset's field that the family has no key for is left out (a window for llama). K-quants need
# row lengths that are multiples of 256: `tiny256`.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layers=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128,
                 vocab_size=512, tied_embeddings=False),
    "tiny256": dict(n_layers=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
                    vocab_size=512, tied_embeddings=True),
    "smollm2-135m": dict(n_layers=30, n_embd=576, n_head=9, n_head_kv=3, head_dim=64, n_ff=1536,
                         vocab_size=49152, tied_embeddings=True, ctx_train=8192, rope_base=100000.0),
    "llama3.2-1b": dict(n_layers=16, n_embd=2048, n_head=32, n_head_kv=8, head_dim=64, n_ff=8192,
                        vocab_size=128256, tied_embeddings=True, ctx_train=131072, rope_base=500000.0),
    "gemma3-270m": dict(n_layers=18, n_embd=640, n_head=4, n_head_kv=1, head_dim=256, n_ff=2048,
                        vocab_size=262144, tied_embeddings=True, ctx_train=32768, rope_base=1000000.0,
                        rms_eps=1e-6, sliding_window=512),
}
POSITIVE_SIZES = ("n_layers", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "vocab_size")


# ---- families ----------------------------------------------------------------------------------
# The GGUF value type of each hyperparameter's key, as llama.cpp's converter writes it.
HPARAM_TYPES = {**dict.fromkeys(INT_HPARAMS, V.UINT32), **dict.fromkeys(FLOAT_HPARAMS + CAP_HPARAMS, V.FLOAT32)}


def synthetic_family(family: str) -> Family:
    """`family/<family>.toml`: its keys, tensors and typical values are all a synthetic model needs."""
    known = families_by_name()
    if family not in known:
        raise ParameterError(f"synthetic family {family!r} is unknown; expected one of {', '.join(sorted(known))}")
    return known[family]


def resolve_shape(family: str, shape: str | dict) -> dict[str, Any]:
    """tied_embeddings and every hyperparameter of the family file: the dict's own fields, then the
    preset's (a dict may name one as "preset", default "tiny"), then the family's typical values
    and defaults."""
    fam = synthetic_family(family)
    overrides = dict(shape) if isinstance(shape, dict) else {"preset": shape}
    preset = overrides.pop("preset", "tiny")
    if preset not in SHAPES:
        raise ParameterError(f"shape preset {preset!r} is unknown; expected one of {', '.join(SHAPES)}")
    fields = ("tied_embeddings", *fam.hparams)
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ParameterError(f"shape fields {unknown} are unknown for {family}; expected some of {', '.join(fields)}")
    given = {**SHAPES[preset], **overrides}
    dims = {"tied_embeddings": given["tied_embeddings"]}
    for name, spec in fam.hparams.items():  # in file order: a default names only earlier sizes
        dims[name] = given[name] if name in given else _default(family, name, spec, dims)
    for name in POSITIVE_SIZES:
        if not isinstance(dims[name], int) or dims[name] <= 0:
            raise ParameterError(f"shape field {name} = {dims[name]!r}, expected a positive integer")
    if dims["n_head"] % dims["n_head_kv"]:
        raise ParameterError(f"{dims['n_head']} query heads are not a multiple of {dims['n_head_kv']} K/V heads")
    return dims


def _default(family: str, name: str, spec: dict, dims: dict[str, Any]) -> Any:
    """The hyperparameter's typical value, else its default; "head_dim" or "n_embd / n_head" are
    computed from the sizes already resolved."""
    value = spec.get("typical", spec.get("default"))
    if value is None:
        raise ParameterError(f"shape field {name} is needed for {family} (family/{family}.toml has no "
                             f"default and no preset gives it); expected it in the shape dict")
    return size_of(value, dims) if isinstance(value, str) else value


# ---- quant mixes -------------------------------------------------------------------------------
def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, and every third
    layer in between (llama-quant.cpp, use_more_bits)."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


@dataclass(frozen=True)
class Mix:
    """llama.cpp's K-quant mixes: `base` everywhere, `more` for the LM head (the tied embedding
    when there is no output.weight) and for attn_v and ffn_down in the layers `_use_more_bits`
    picks. (llama-quant.cpp, llama_tensor_get_type)"""

    base: GGMLQuantizationType
    more: GGMLQuantizationType
    file_type: LlamaFileType

    def qtype(self, name: str, layer: int | None, n_layers: int, tied: bool) -> GGMLQuantizationType:
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            return self.more
        if layer is not None and name.split(".")[2] in ("attn_v", "ffn_down") and _use_more_bits(layer, n_layers):
            return self.more
        return self.base


MIXES = {
    "Q4_K_M": Mix(Q.Q4_K, Q.Q6_K, LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_M": Mix(Q.Q5_K, Q.Q6_K, LlamaFileType.MOSTLY_Q5_K_M),
}
FILE_TYPES = {
    Q.F32: LlamaFileType.ALL_F32, Q.F16: LlamaFileType.MOSTLY_F16, Q.BF16: LlamaFileType.MOSTLY_BF16,
    Q.Q4_0: LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    Q.Q5_0: LlamaFileType.MOSTLY_Q5_0, Q.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    Q.Q8_0: LlamaFileType.MOSTLY_Q8_0, Q.Q4_K: LlamaFileType.MOSTLY_Q4_K_S,
    Q.Q5_K: LlamaFileType.MOSTLY_Q5_K_S, Q.Q6_K: LlamaFileType.MOSTLY_Q6_K,
}


def _type_chooser(qtype: str) -> tuple[Callable[..., GGMLQuantizationType], LlamaFileType]:
    if qtype.upper() in MIXES:
        mix = MIXES[qtype.upper()]
        return mix.qtype, mix.file_type
    single = qtype_named(qtype)
    return (lambda name, layer, n_layers, tied: single), FILE_TYPES[single]


# ---- the tensor plan ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write. shape is in numpy order (rows, row_length); `source` is the name whose
    random values it holds (itself, or layer 0's tensor in fast mode)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    source: str
    fixed: tuple[float, ...] | None = None  # values computed, not random (rope_freqs.weight)

    @property
    def is_norm(self) -> bool:
        return self.name.endswith("norm.weight")

    @property
    def is_bias(self) -> bool:
        return self.name.endswith(".bias")


def plan_tensors(family: str, dims: dict[str, Any], qtype: str, fast: bool = False) -> list[TensorPlan]:
    """Every tensor of the model in file order: token_embd, the layers, the other global tensors."""
    choose, _ = _type_chooser(qtype)
    fam = synthetic_family(family)
    shapes = tensor_shapes(fam)
    plans = []
    for name, base, layer, source in _tensor_names(fam, dims, fast):
        shape = tuple(reversed(shape_of(shapes[base], dims)))  # GGUF order -> numpy order
        if len(shape) == 1:  # norm weights and biases
            chosen = Q.F32
        else:
            chosen = choose(name, layer, dims["n_layers"], dims["tied_embeddings"])
            chosen = compatible_type(chosen, shape[-1])
        plans.append(TensorPlan(name, shape, chosen, source))
    return plans


def _tensor_names(fam: Family, dims: dict[str, Any], fast: bool) -> Iterator[tuple]:
    """(name, name in the family file, layer or None, source name) of every tensor, in file order.
    Optional layer tensors are written too: their presence is what turns a feature on (Qwen 2's
    biases). output.weight is written only when the embedding is untied."""
    yield "token_embd.weight", "token_embd.weight", None, "token_embd.weight"
    for layer in range(dims["n_layers"]):
        for base in fam.layer_tensors + fam.layer_optional:
            name = f"blk.{layer}.{base}"
            yield name, base, layer, f"blk.0.{base}" if fast else name
    rest = [name for name in fam.global_tensors if name != "token_embd.weight"]
    if not dims["tied_embeddings"]:
        rest.append("output.weight")
    for name in rest:
        yield name, name, None, name


def tensor_values(plan: TensorPlan, seed: int = 0) -> np.ndarray:
    """The float32 values a tensor is meant to hold (before quantization), numpy order."""
    if plan.fixed is not None:
        return np.asarray(plan.fixed, dtype=np.float32).reshape(plan.shape)
    values = _standard_normal(plan.source, plan.shape, seed)
    if plan.is_norm:
        values *= NORM_STD
        values += 1.0
    elif plan.is_bias:
        values *= BIAS_STD
    else:
        values *= MATRIX_STD
    return values


def _standard_normal(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """N(0, 1) float32 of `shape`, in fixed-size chunks with their own streams, filled in parallel."""
    out = np.empty(shape, dtype=np.float32)
    flat = out.reshape(-1)
    starts = range(0, flat.size, _CHUNK_VALUES)
    key = zlib.crc32(name.encode())

    def fill(start: int) -> None:
        rng = np.random.default_rng([seed, key, start // _CHUNK_VALUES])
        rng.standard_normal(out=flat[start:start + _CHUNK_VALUES], dtype=np.float32)

    if len(starts) == 1:
        fill(0)
    else:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(fill, starts))
    return out


def encode_tensor(plan: TensorPlan, seed: int = 0) -> np.ndarray:
    """The bytes stored for a tensor: (rows, row_bytes) uint8 (a 1-D norm is one row)."""
    values = tensor_values(plan, seed)
    return quantize(values.reshape(-1, plan.shape[-1]), plan.qtype)


# ---- the tokenizer -----------------------------------------------------------------------------
@lru_cache(maxsize=2)
def _source_tokenizer(source: str) -> dict[str, Any]:
    gf = GGUFFile(resolve_model(source))
    try:
        return {k: v for k, v in gf.metadata.items() if k.startswith("tokenizer.")}
    finally:
        gf.close()


def tokenizer_metadata(vocab: int | None = None, source: str = TOKENIZER_SOURCE) -> dict[str, Any]:
    """The `tokenizer.*` keys of `source`'s GGUF, its vocabulary cut or padded to `vocab` tokens."""
    meta = dict(_source_tokenizer(source))
    tokens = list(meta["tokenizer.ggml.tokens"])
    if vocab is None or vocab == len(tokens):
        return meta
    special = {k: v for k, v in meta.items() if k.endswith("_token_id")}
    needed = max(special.values(), default=-1) + 1
    if vocab < needed:
        raise ParameterError(f"vocab {vocab} would drop special tokens {special}; expected at least {needed}")
    if vocab < len(tokens):
        return _truncated(meta, vocab)
    return _padded(meta, vocab)


def _truncated(meta: dict[str, Any], vocab: int) -> dict[str, Any]:
    kept = meta["tokenizer.ggml.tokens"][:vocab]
    known = set(kept)
    out = dict(meta)
    out["tokenizer.ggml.tokens"] = kept
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in meta:
            out[key] = meta[key][:vocab]
    if "tokenizer.ggml.merges" in meta:
        merges = []
        for merge in meta["tokenizer.ggml.merges"]:
            left, _, right = merge.partition(" ")
            if left in known and right in known and left + right in known:
                merges.append(merge)
        out["tokenizer.ggml.merges"] = merges
    return out


def _padded(meta: dict[str, Any], vocab: int) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]
    extra = vocab - len(tokens)
    out = dict(meta)
    out["tokenizer.ggml.tokens"] = tokens + [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    if "tokenizer.ggml.token_type" in meta:
        pad_types = np.full(extra, int(TokenType.UNUSED), dtype=np.int32)
        out["tokenizer.ggml.token_type"] = np.concatenate([meta["tokenizer.ggml.token_type"], pad_types])
    if "tokenizer.ggml.scores" in meta:
        pad_scores = np.full(extra, -1000.0, dtype=np.float32)
        out["tokenizer.ggml.scores"] = np.concatenate([meta["tokenizer.ggml.scores"], pad_scores])
    return out


_ARRAY_ITEM_TYPES = {np.dtype(np.int32): V.INT32, np.dtype(np.uint32): V.UINT32,
                     np.dtype(np.float32): V.FLOAT32, np.dtype(np.int64): V.INT64}


def _add_value(writer: GGUFWriter, key: str, value: Any) -> None:
    """Write a metadata value read by GGUFFile with the GGUF type llama.cpp uses for it."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int) and value >= 0:  # token ids and counts
        writer.add_uint32(key, value)
    elif isinstance(value, int):  # -1 marks an absent token id in some files
        writer.add_int32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_key_value(key, value, V.STRING)
    elif isinstance(value, np.ndarray):
        writer.add_key_value(key, value.tolist(), V.ARRAY, sub_type=_ARRAY_ITEM_TYPES[value.dtype])
    elif isinstance(value, list) and value and isinstance(value[0], str):
        writer.add_key_value(key, value, V.ARRAY, sub_type=V.STRING)
    else:
        raise ParameterError(f"metadata {key!r} = {value!r:.80}: expected a scalar, a string or an array")


# ---- writing -----------------------------------------------------------------------------------
def hparam_metadata(family: str, dims: dict[str, Any]) -> dict[str, tuple[Any, GGUFValueType]]:
    """The `{prefix}.*` key of every hyperparameter in the family file: key -> (value, GGUF type)."""
    fam = synthetic_family(family)
    return {f"{fam.prefix}.{spec['key']}": (dims[name], HPARAM_TYPES[name]) for name, spec in fam.hparams.items()}


def write_synthetic_gguf(path: str | os.PathLike, family: str = "llama", shape: str | dict = "tiny",
                         qtype: str = "Q8_0", seed: int = 0, *, vocab: int | None = None,
                         fast: bool = False, tokenizer: str = TOKENIZER_SOURCE,
                         alignment: int | None = None, progress: bool = False,
                         rope_scaling: RopeScaling | None = None, rope_freqs: bool = True) -> Path:
    """Write a random model of `family` (a file `family/<family>.toml`) and `shape` to `path`;
    returns the path.

    qtype: a GGML type name for every matrix ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0",
    "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K") or a mix ("Q4_K_M", "Q5_K_M"). vocab overrides the
    shape's vocabulary size; the tokenizer (`tokenizer.*` keys of the model named or at the path
    `tokenizer`) is cut or padded to match. rope_scaling writes the `{prefix}.rope.scaling.*` keys,
    except that a "llama3" scaling is written as llama.cpp's converter does, as the
    rope_freqs.weight tensor of per-pair factors (as keys when rope_freqs is False), and a
    "longrope" one as Phi-3's converter does: rope_factors_long / rope_factors_short tensors (made-up
    smooth factors), the original context and the attention factor sqrt(1 + ln(s) / ln(original)).
    """
    if not isinstance(seed, int) or seed < 0:
        raise ParameterError(f"seed = {seed!r}, expected a non-negative integer")
    dims = resolve_shape(family, shape if vocab is None else _with_vocab(shape, vocab))
    fam = synthetic_family(family)
    rope_plans, extra = _rope_scaling_parts(fam.prefix, dims, rope_scaling, rope_freqs)
    plans = rope_plans + plan_tensors(family, dims, qtype, fast)
    path = Path(path)
    if not path.parent.is_dir():
        raise ParameterError(f"output folder {path.parent} does not exist")
    partial = path.with_name(path.name + ".partial")  # renamed when complete: no truncated files
    writer = GGUFWriter(partial, fam.architectures[0])
    try:
        _write_header(writer, family, shape, qtype, seed, fast, alignment, dims, tokenizer, plans, extra)
        with tqdm(total=len(plans), desc=f"writing {path.name}", unit="tensor", disable=not progress) as bar:
            for data in _encoded_in_order(plans, seed, fast):
                writer.write_tensor_data(data)
                bar.update(1)
        writer.close()
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)
    return path


def _rope_scaling_parts(prefix: str, dims: dict[str, Any], scaling: RopeScaling | None,
                        rope_freqs: bool) -> tuple[list[TensorPlan], dict[str, tuple[Any, GGUFValueType]]]:
    """The tensors written before the others and the keys that declare a RoPE scaling."""
    if scaling is None or not scaling.active:
        return [], {}
    if scaling.type == "llama3" and rope_freqs:
        factors = llama3_freq_factors(dims["rope_dim"], dims["rope_base"], scaling)
        return [TensorPlan("rope_freqs.weight", (factors.size,), Q.F32, "rope_freqs.weight",
                           fixed=tuple(float(f) for f in factors))], {}
    plans = _longrope_plans(dims["rope_dim"] // 2, scaling.factor) if scaling.type == "longrope" else []
    return plans, rope_scaling_metadata(prefix, scaling)


def _write_header(writer: GGUFWriter, family: str, shape: str | dict, qtype: str, seed: int, fast: bool,
                  alignment: int | None, dims: dict[str, Any], tokenizer: str, plans: list[TensorPlan],
                  extra: dict[str, tuple[Any, GGUFValueType]]) -> None:
    """Metadata and tensor infos: everything before the tensor data."""
    _, file_type = _type_chooser(qtype)
    _add_general(writer, family, shape, qtype, seed, fast, file_type, alignment)
    for key, (value, vtype) in {**hparam_metadata(family, dims), **extra}.items():
        writer.add_key_value(key, value, vtype)
    for key, value in tokenizer_metadata(dims["vocab_size"], tokenizer).items():
        _add_value(writer, key, value)
    for plan in plans:
        byte_shape = (*plan.shape[:-1], quant(plan.qtype).row_bytes(plan.shape[-1]))
        n_bytes = int(np.prod(byte_shape, dtype=np.int64))
        writer.add_tensor_info(plan.name, byte_shape, np.dtype(np.uint8), n_bytes, raw_dtype=plan.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()


def _longrope_plans(half: int, factor: float) -> list[TensorPlan]:
    """LongRoPE factor tensors: long ones growing from 1 to the factor over the pairs, short ones
    from 1 to 1.5 (real files hold fitted values of these shapes)."""
    share = np.arange(half) / max(1, half - 1)
    long = 1.0 + (factor - 1.0) * share ** 2
    short = 1.0 + 0.5 * share
    return [TensorPlan(name, (half,), Q.F32, name, fixed=tuple(float(v) for v in values))
            for name, values in (("rope_factors_long.weight", long), ("rope_factors_short.weight", short))]


def rope_scaling_metadata(prefix: str, s: RopeScaling) -> dict[str, tuple[Any, GGUFValueType]]:
    """The `{prefix}.rope.scaling.*` keys llama.cpp's converter writes for a scaling (plus Llama 3's
    low/high frequency factors, which it never writes: it stores rope_freqs.weight instead)."""
    base = f"{prefix}.rope.scaling"
    if s.type == "longrope":  # Phi3MiniModel: no type or factor key; the factor is context / original
        attn_factor = math.sqrt(1 + math.log(s.factor) / math.log(s.original_ctx)) if s.factor > 1 else 1.0
        return {f"{base}.original_context_length": (s.original_ctx, V.UINT32),
                f"{base}.attn_factor": (attn_factor, V.FLOAT32)}
    keys = {f"{base}.type": (s.type, V.STRING), f"{base}.factor": (s.factor, V.FLOAT32)}
    if s.original_ctx:
        keys[f"{base}.original_context_length"] = (s.original_ctx, V.UINT32)
    if s.type == "yarn":
        keys[f"{base}.yarn_beta_fast"] = (s.beta_fast, V.FLOAT32)
        keys[f"{base}.yarn_beta_slow"] = (s.beta_slow, V.FLOAT32)
        if s.attn_factor != 1.0:
            keys[f"{base}.attn_factor"] = (s.attn_factor, V.FLOAT32)
    if s.type == "llama3":
        keys[f"{base}.low_freq_factor"] = (s.low_freq_factor, V.FLOAT32)
        keys[f"{base}.high_freq_factor"] = (s.high_freq_factor, V.FLOAT32)
    return keys


def _encoded_in_order(plans: list[TensorPlan], seed: int, fast: bool) -> Iterator[np.ndarray]:
    """Each plan's bytes in order; the next tensor is encoded while the caller writes this one.
    In fast mode, layer 0's bytes are kept and repeated (one worker, so no locking)."""
    layer0: dict[tuple[str, GGMLQuantizationType], np.ndarray] = {}

    def encode(plan: TensorPlan) -> np.ndarray:
        key = (plan.source, plan.qtype)
        if key not in layer0:
            data = encode_tensor(plan, seed)
            if not (fast and plan.name.startswith("blk.")):
                return data
            layer0[key] = data
        return layer0[key]

    with ThreadPoolExecutor(max_workers=1) as worker:
        ahead: deque = deque()
        for plan in plans:
            ahead.append(worker.submit(encode, plan))
            if len(ahead) > 1:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


def _with_vocab(shape: str | dict, vocab: int) -> dict:
    base = dict(shape) if isinstance(shape, dict) else {"preset": shape}
    return {**base, "vocab_size": vocab}


def _add_general(writer: GGUFWriter, family: str, shape: str | dict, qtype: str, seed: int,
                 fast: bool, file_type: LlamaFileType, alignment: int | None) -> None:
    label = shape if isinstance(shape, str) else shape.get("preset", "tiny") + " (custom)"
    name = f"synthetic {family} {label} {qtype.upper()} seed {seed}"
    if fast:
        name += " (fast: every layer repeats layer 0's weights)"
    writer.add_type("model")
    writer.add_name(name)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(2)
    if alignment is not None:
        writer.add_custom_alignment(alignment)


def plant_nan(path: str | os.PathLike, tensor: str = "blk.0.attn_norm.weight") -> Path:
    """Overwrite the first value of an F32 `tensor` of the GGUF file at `path` with NaN (a damaged
    file for the non-finite checks: with the default tensor every logit is NaN); returns the path."""
    gf = GGUFFile(path)
    info = gf.tensor(tensor)
    offset, kind = info.offset, info.qtype
    gf.close()
    if kind != GGMLQuantizationType.F32:
        raise ParameterError(f"{tensor} is {kind.name}, expected an F32 tensor to plant a NaN in")
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.float32(np.nan).tobytes())
    return Path(path)
