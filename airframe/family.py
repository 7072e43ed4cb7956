"""Families as data: `family/<name>.toml` says how a GGUF architecture is stored and what differs.

`load_config(gguf_file)` matches `general.architecture` against every family file, reads the
hyperparameters through the family's key table (with its defaults) and returns a ModelConfig that
every backend uses. The runtime branches on named switches, never on the architecture's name.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from .errors import GGUFError, UnsupportedError, excerpt
from .gguf_file import GGUFFile
from .resources import family_dir
from .rope_scaling import NONE as NO_ROPE_SCALING, RopeScaling, read_rope_scaling

# key: GGUF key after the prefix; default: the value when a file lacks the key; typical: a typical
# model's value where it differs from the default (synthetic models take it)
HPARAM_FIELDS = ("key", "default", "typical")

SWITCH_DEFAULTS: dict[str, Any] = {
    "rope_style": "normal",
    "activation": "silu",
    "qk_norm": False,
    "post_norms": False,
    "embed_scale": "none",
    "sliding_window": 0,
    "sliding_window_pattern": 0,
    "rope_base_local": 0.0,
    "fused_qkv": False,
    "fused_gate_up": False,
}
SWITCH_CHOICES = {
    "rope_style": ("normal", "neox"),
    "activation": ("silu", "gelu_tanh"),
    "embed_scale": ("none", "sqrt_n_embd"),
}


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    prefix: str
    hparams: dict[str, dict]
    global_tensors: tuple[str, ...]
    global_optional: tuple[str, ...]
    layer_tensors: tuple[str, ...]
    layer_optional: tuple[str, ...]
    switches: dict[str, Any]


@dataclass(frozen=True)
class ModelConfig:
    """Everything a backend needs to know about a model's shape and its family's switches."""

    family: str
    architecture: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    rope_dim: int
    rope_base: float
    rms_eps: float
    ctx_train: int
    vocab_size: int
    tied_embeddings: bool
    rope_style: str = "normal"
    activation: str = "silu"
    qk_norm: bool = False
    post_norms: bool = False
    embed_scale: str = "none"
    sliding_window: int = 0
    sliding_window_pattern: int = 0
    rope_base_local: float = 0.0
    fused_qkv: bool = False            # one attn_qkv matrix: Q rows, then K, then V (Phi-3)
    fused_gate_up: bool = False        # ffn_up holds 2 n_ff rows: gate, then up (Phi-3)
    attn_logit_softcap: float = 0.0    # scores -> cap * tanh(scores / cap); 0: off (Gemma 2)
    final_logit_softcap: float = 0.0   # logits -> cap * tanh(logits / cap); 0: off (Gemma 2)
    rope_scaling: RopeScaling = NO_ROPE_SCALING
    layer_tensors: tuple[str, ...] = field(default=(), repr=False)

    @property
    def n_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_kv(self) -> int:
        return self.n_head_kv * self.head_dim

    def is_local_layer(self, layer: int) -> bool:
        """True for a sliding-window layer. With a window and pattern 0, every layer is one (Phi-3)."""
        if not self.sliding_window:
            return False
        if not self.sliding_window_pattern:
            return True
        return (layer + 1) % self.sliding_window_pattern != 0

    def layer_rope_base(self, layer: int) -> float:
        if self.is_local_layer(layer) and self.rope_base_local:
            return self.rope_base_local
        return self.rope_base

    def layer_rope_scaling(self, layer: int) -> RopeScaling:
        """Local layers with their own RoPE base are never scaled (llama.cpp: Gemma 3's SWA layers)."""
        if self.is_local_layer(layer) and self.rope_base_local:
            return NO_ROPE_SCALING
        return self.rope_scaling

    @property
    def qkv_bias(self) -> bool:
        """Q, K and V projections add a bias (Qwen 2): the optional attn_q.bias tensors are present."""
        return "attn_q.bias" in self.layer_tensors

    def embedding_scale(self) -> float:
        return math.sqrt(self.n_embd) if self.embed_scale == "sqrt_n_embd" else 1.0

    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


def _parse_family(path: Path) -> Family:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    tensors = data.get("tensors", {})
    switches = dict(SWITCH_DEFAULTS)
    switches.update(data.get("switches", {}))
    for name, value in switches.items():
        if name not in SWITCH_DEFAULTS:
            raise ValueError(f"{path}: unknown switch {name!r}")
        if name in SWITCH_CHOICES and value not in SWITCH_CHOICES[name]:
            raise ValueError(f"{path}: switch {name} = {value!r}, expected one of {SWITCH_CHOICES[name]}")
    _check_hparams(path, data["hparams"])
    return Family(
        name=path.stem,
        architectures=tuple(data["architectures"]),
        prefix=data.get("prefix", data["architectures"][0]),
        hparams=data["hparams"],
        global_tensors=tuple(tensors.get("global", ())),
        global_optional=tuple(tensors.get("global_optional", ())),
        layer_tensors=tuple(tensors.get("layer", ())),
        layer_optional=tuple(tensors.get("layer_optional", ())),
        switches=switches,
    )


def _check_hparams(path: Path, hparams: dict) -> None:
    for name, spec in hparams.items():
        if not isinstance(spec, dict) or "key" not in spec or set(spec) - set(HPARAM_FIELDS):
            raise ValueError(f"{path}: hparam {name} = {spec!r}, expected a table with a key and no "
                             f"fields but {', '.join(HPARAM_FIELDS)}")


@lru_cache(maxsize=1)
def families() -> dict[str, Family]:
    """architecture name -> Family, from every file in `family/`."""
    found = {}
    for path in sorted(family_dir().glob("*.toml")):
        fam = _parse_family(path)
        for arch in fam.architectures:
            found[arch] = fam
    return found


def families_by_name() -> dict[str, Family]:
    """family name (the file's stem) -> Family."""
    return {fam.name: fam for fam in families().values()}


def family_for(architecture: str) -> Family:
    known = families()
    if architecture not in known:
        raise UnsupportedError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(known))}"
        )
    return known[architecture]


INT_HPARAMS = ("n_layers", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "head_dim_v",
               "rope_dim", "ctx_train", "vocab_size", "sliding_window")
FLOAT_HPARAMS = ("rope_base", "rms_eps")
CAP_HPARAMS = ("attn_logit_softcap", "final_logit_softcap")  # 0 means off
MAX_HPARAM = (1 << 31) - 1  # every size must fit the int32 indices of the GPU kernels
INTEGER_TYPES = frozenset(GGMLQuantizationType[t] for t in ("I8", "I16", "I32", "I64"))

# Expected GGUF shapes (row length first) of the tensors every family shares, in hyperparameters.
TENSOR_SHAPES = {
    "token_embd.weight": ("n_embd", "vocab_size"),
    "output.weight": ("n_embd", "vocab_size"),
    "output_norm.weight": ("n_embd",),
    "rope_freqs.weight": ("rope_dim / 2",),
    "rope_factors_long.weight": ("rope_dim / 2",),
    "rope_factors_short.weight": ("rope_dim / 2",),
    "attn_qkv.weight": ("n_embd", "n_qkv"),
    "attn_q.bias": ("n_head * head_dim",),
    "attn_k.bias": ("n_head_kv * head_dim",),
    "attn_v.bias": ("n_head_kv * head_dim_v",),
    "attn_norm.weight": ("n_embd",),
    "attn_q.weight": ("n_embd", "n_head * head_dim"),
    "attn_k.weight": ("n_embd", "n_head_kv * head_dim"),
    "attn_v.weight": ("n_embd", "n_head_kv * head_dim_v"),
    "attn_output.weight": ("n_head * head_dim_v", "n_embd"),
    "attn_q_norm.weight": ("head_dim",),
    "attn_k_norm.weight": ("head_dim",),
    "post_attention_norm.weight": ("n_embd",),
    "ffn_norm.weight": ("n_embd",),
    "ffn_gate.weight": ("n_embd", "n_ff"),
    "ffn_up.weight": ("n_embd", "n_ff"),
    "ffn_down.weight": ("n_ff", "n_embd"),
    "post_ffw_norm.weight": ("n_embd",),
}


def _default(gf: GGUFFile, key: str, spec: dict, resolved: dict) -> Any:
    if "default" not in spec:
        raise GGUFError(f"{gf.path}: required key {key!r} is missing")
    default = spec["default"]
    if default == "tokens":
        tokens = gf.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list) and tokens:
            return len(tokens)
        shape = gf.tensor("token_embd.weight").shape
        if len(shape) != 2:
            raise GGUFError(f"{gf.path}: token_embd.weight has shape {list(shape)}, expected 2 dimensions")
        return shape[1]
    if isinstance(default, str):  # "n_head", "head_dim" or "n_embd / n_head"
        parts = default.split(" / ")
        value = resolved[parts[0]]
        if len(parts) == 1:
            return value
        if resolved[parts[1]] == 0:
            raise GGUFError(f"{gf.path}: {key} is missing and {parts[1]} is 0, expected a positive {parts[1]}")
        return value // resolved[parts[1]]
    return default


def _hparam(gf: GGUFFile, fam: Family, name: str, spec: dict, resolved: dict) -> Any:
    key = f"{fam.prefix}.{spec['key']}"
    value = gf.get(key)
    if value is None:
        value = _default(gf, key, spec, resolved)
    elif hasattr(value, "shape"):  # per-layer arrays (e.g. head counts) must be uniform here
        values = value.tolist()
        if len(set(values)) != 1:
            raise UnsupportedError(f"{gf.path}: {key} = {excerpt(values)}, expected one value for every layer")
        value = values[0]
    return _checked(gf, key, name, value)


def _checked(gf: GGUFFile, key: str, name: str, value: Any) -> Any:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if name in INT_HPARAMS:
        if not number or not math.isfinite(value) or value != int(value) or not 0 <= value <= MAX_HPARAM:
            raise GGUFError(f"{gf.path}: {key} ({name}) = {excerpt(value)}, expected an integer in 0..{MAX_HPARAM}")
        return int(value)
    if name in FLOAT_HPARAMS:
        if not number or not math.isfinite(value) or value <= 0:
            raise GGUFError(f"{gf.path}: {key} ({name}) = {excerpt(value)}, expected a finite positive number")
        return float(value)
    if name in CAP_HPARAMS:
        if not number or not math.isfinite(value) or value < 0:
            raise GGUFError(f"{gf.path}: {key} ({name}) = {excerpt(value)}, expected a finite number >= 0 (0: off)")
        return float(value)
    return value


def load_config(gf: GGUFFile, rope_scaling: RopeScaling | None = None) -> ModelConfig:
    """The model's config; `rope_scaling` replaces the scaling the file declares (user's choice)."""
    try:
        fam = family_for(gf.architecture)
    except UnsupportedError as e:
        raise UnsupportedError(f"{gf.path}: {e}") from None
    resolved: dict[str, Any] = {}
    for name, spec in fam.hparams.items():
        resolved[name] = _hparam(gf, fam, name, spec, resolved)
    _check_shapes(gf, resolved)
    _check_tensors(gf, fam, resolved)
    if rope_scaling is None:
        rope_scaling = read_rope_scaling(gf, fam.prefix, resolved["ctx_train"])
    elif rope_scaling.active and not rope_scaling.original_ctx:
        rope_scaling = replace(rope_scaling, original_ctx=resolved["ctx_train"])
    switches = dict(fam.switches)
    if "sliding_window" in resolved:
        switches["sliding_window"] = resolved.pop("sliding_window")
    return ModelConfig(
        family=fam.name,
        architecture=gf.architecture,
        tied_embeddings="output.weight" not in gf.tensors,
        layer_tensors=fam.layer_tensors + tuple(
            t for t in fam.layer_optional if f"blk.0.{t}" in gf.tensors),
        rope_scaling=rope_scaling,
        **resolved,
        **switches,
    )


def _check_shapes(gf: GGUFFile, hp: dict) -> None:
    for name in ("n_layers", "n_embd", "n_ff", "n_head", "head_dim", "head_dim_v", "vocab_size", "ctx_train"):
        if hp[name] <= 0:
            raise GGUFError(f"{gf.path}: {name} = {hp[name]}, expected a positive value")
    if hp["n_head_kv"] <= 0 or hp["n_head"] % hp["n_head_kv"]:
        raise GGUFError(f"{gf.path}: {hp['n_head']} query heads are not a multiple of {hp['n_head_kv']} K/V heads")
    if hp["rope_dim"] > hp["head_dim"] or hp["rope_dim"] % 2:
        raise GGUFError(f"{gf.path}: rope dimension {hp['rope_dim']}, expected an even value <= head_dim {hp['head_dim']}")


def _check_tensors(gf: GGUFFile, fam: Family, hp: dict) -> None:
    """The file's tensors are exactly the family's for hp["n_layers"] layers: every required one
    present, an optional layer tensor in every layer or in none, nothing else (a tensor of a
    layer beyond the count, an unknown name), each of the expected shape and of a float or
    quantized type. A damaged block count or tensor list is refused instead of run."""
    n_layers = hp["n_layers"]
    if n_layers > len(gf.tensors):  # before looping over layers: the count may be hostile
        raise GGUFError(f"{gf.path}: n_layers = {n_layers}, but the file has only {len(gf.tensors)} tensors")
    missing = [t for t in fam.global_tensors if t not in gf.tensors]
    for i in range(n_layers):
        missing += [f"blk.{i}.{t}" for t in fam.layer_tensors if f"blk.{i}.{t}" not in gf.tensors]
    if missing:
        raise GGUFError(f"{gf.path}: {fam.name} model is missing tensors: {_listed(missing)}")
    known = set(fam.global_tensors) | set(fam.global_optional)
    for t in fam.layer_optional:
        present = [i for i in range(n_layers) if f"blk.{i}.{t}" in gf.tensors]
        if present and len(present) != n_layers:
            absent = [f"blk.{i}.{t}" for i in range(n_layers) if i not in present]
            raise GGUFError(f"{gf.path}: {t} is in {len(present)} of {n_layers} layers, expected every "
                            f"layer or none; missing: {_listed(absent)}")
    layer_names = set(fam.layer_tensors) | set(fam.layer_optional)
    unexpected = [name for name in gf.tensors if name not in known and not _in_layers(name, layer_names, n_layers)]
    if unexpected:
        raise GGUFError(f"{gf.path}: tensors {_listed(unexpected)} are not part of a {n_layers}-layer "
                        f"{fam.name} model; expected only its tensors (is the block count right?)")
    shapes = tensor_shapes(fam)
    for name, t in gf.tensors.items():
        if t.qtype in INTEGER_TYPES:
            raise GGUFError(f"{gf.path}: tensor {name!r} has type {t.qtype.name}, expected a float or quantized type")
        base = name.split(".", 2)[2] if name.startswith("blk.") else name
        if base in shapes:
            expected = shape_of(shapes[base], hp)
            if t.shape != expected:
                dims = ", ".join(shapes[base])
                raise GGUFError(f"{gf.path}: tensor {name!r} has shape {list(t.shape)}, "
                                f"expected [{dims}] = {list(expected)}")


def _in_layers(name: str, layer_names: set[str], n_layers: int) -> bool:
    """`name` is blk.<i>.<t> with i < n_layers (written without leading zeros) and t a layer tensor."""
    parts = name.split(".", 2)
    return len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[1] == str(int(parts[1])) \
        and int(parts[1]) < n_layers and parts[2] in layer_names


def _listed(names: list[str]) -> str:
    """Up to five tensor names (each at most gguf_file.MAX_NAME characters), and how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def tensor_shapes(fam: Family) -> dict[str, tuple[str, ...]]:
    """TENSOR_SHAPES as this family stores them (Phi-3's ffn_up holds gate and up)."""
    shapes = dict(TENSOR_SHAPES)
    if fam.switches["fused_gate_up"]:
        shapes["ffn_up.weight"] = ("n_embd", "n_ff * 2")
    return shapes


def shape_of(exprs: tuple[str, ...], hp: dict) -> tuple[int, ...]:
    """A shape from `tensor_shapes`, in numbers: the hyperparameters' values and n_qkv (the rows of
    Phi-3's fused attn_qkv)."""
    n_qkv = (hp["n_head"] + hp["n_head_kv"]) * hp["head_dim"] + hp["n_head_kv"] * hp["head_dim_v"]
    sizes = dict(hp, n_qkv=n_qkv)
    return tuple(size_of(expr, sizes) for expr in exprs)


def size_of(expr: str, hp: dict) -> int:
    """'n_head * head_dim', 'rope_dim / 2' or a single hyperparameter name."""
    parts = expr.split()
    if len(parts) == 1:
        return hp[expr]
    left, op, right = parts
    right_value = int(right) if right.isdigit() else hp[right]
    return hp[left] * right_value if op == "*" else hp[left] // right_value
