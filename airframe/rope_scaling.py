"""RoPE scaling: the rotation frequencies of a model run beyond (or re-tuned for) its trained context.

Every backend rotates pair i of a head at position p by the angle p * inv_freq[i] and multiplies
the rotated values by `mscale` (1 unless YaRN). This module is the one place that computes both,
from what the GGUF file declares (`{arch}.rope.scaling.*` keys, the `rope_freqs.weight` tensor)
or what the user asks for (`open_model(..., rope_scaling="yarn", rope_scale=4.0)`).

Types (docs/EXTENDED_CONTEXT.md gives the formulas and their sources):
  none    inv_freq[i] = base^(-2i/d)
  linear  inv_freq[i] / factor (position interpolation, https://arxiv.org/abs/2306.15595)
  yarn    per-pair blend of interpolated and original frequencies by a linear ramp between the
          dims that rotate beta_fast and beta_slow times over the original context, and
          mscale = attn_factor * (0.1 ln(factor) + 1) (https://arxiv.org/abs/2309.00071, eq. 17-22)
  llama3  inv_freq[i] / freq_factors[i]: the file's rope_freqs.weight, or computed from the factor,
          low/high frequency factors and original context as Meta's Llama 3.1 reference does.
  longrope  (Phi-3 128k, Phi-3.5) inv_freq[i] / rope_factors_long[i] when the context is longer than
          the original one, else / rope_factors_short[i]; mscale = the file's attn_factor.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import numpy as np

from .errors import GGUFError, ParameterError, excerpt

TYPES = ("none", "linear", "yarn", "llama3", "longrope")
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
MAX_POSITIONS = (1 << 31) - 1  # positions are int32 on every backend
log = logging.getLogger("airframe.rope")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are scaled. `factor` is the context extension s (>= 1 in practice)."""

    type: str = "none"
    factor: float = 1.0
    original_ctx: int = 0          # the context the model was trained at; 0: the file's context_length
    attn_factor: float = 1.0       # extra multiplier of YaRN's mscale
    beta_fast: float = 32.0        # YaRN ramp ends: dims rotating more than beta_fast times keep their
    beta_slow: float = 1.0         # frequency, fewer than beta_slow times are fully interpolated
    ext_factor: float = 1.0        # YaRN: weight of the ramp (llama.cpp's yarn_ext_factor)
    low_freq_factor: float = 1.0   # Llama 3: wavelengths above original_ctx / low_freq_factor are / factor
    high_freq_factor: float = 4.0  # Llama 3: wavelengths below original_ctx / high_freq_factor are kept

    def __post_init__(self):
        if self.type not in TYPES:
            raise ParameterError(f"rope scaling type {self.type!r}, expected one of {', '.join(TYPES)}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ParameterError(f"rope scale factor {self.factor!r}, expected a finite positive number")

    @property
    def active(self) -> bool:
        return self.type != "none"


NONE = RopeScaling()

# GGUF key after `{arch}.rope.scaling.` -> RopeScaling field
_KEYS = {
    "factor": "factor",
    "original_context_length": "original_ctx",
    "attn_factor": "attn_factor",
    "yarn_attn_factor": "attn_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_ext_factor": "ext_factor",
    "low_freq_factor": "low_freq_factor",    # not written by llama.cpp (it writes rope_freqs.weight);
    "high_freq_factor": "high_freq_factor",  # read when a file declares type "llama3" without the tensor
}


def read_rope_scaling(gf, prefix: str, ctx_train: int) -> RopeScaling:
    """The scaling a GGUF file declares; NONE when it declares none (or factor 1 of a linear type)."""
    if LONGROPE_TENSORS[0] in gf.tensors:
        return _longrope(gf, prefix, ctx_train)
    kind = gf.value(f"{prefix}.rope.scaling.type", "string")
    factor = gf.value(f"{prefix}.rope.scaling.factor", "number")
    if kind is None and factor is None:
        # older files: {arch}.rope.scale_linear
        linear = gf.value(f"{prefix}.rope.scale_linear", "number")
        if linear is None or float(linear) == 1.0:
            return NONE
        if linear <= 0:
            raise GGUFError(f"{gf.path}: {prefix}.rope.scale_linear = {linear}, expected a positive number")
        return RopeScaling("linear", float(linear), ctx_train)
    kind = "linear" if kind is None else kind
    if kind == "longrope":
        raise GGUFError(f"{gf.path}: {prefix}.rope.scaling.type = 'longrope' without the tensors "
                        f"{' and '.join(LONGROPE_TENSORS)}; expected both")
    if kind not in TYPES:
        raise GGUFError(f"{gf.path}: {prefix}.rope.scaling.type = {excerpt(kind)}, expected one of {', '.join(TYPES)}")
    fields = {}
    for key, name in _KEYS.items():
        value = gf.value(f"{prefix}.rope.scaling.{key}", "number")
        if value is None:
            continue
        if name == "original_ctx" and (value != int(value) or not 0 <= value <= MAX_POSITIONS):
            raise GGUFError(f"{gf.path}: {prefix}.rope.scaling.{key} = {value}, expected an integer in 0..{MAX_POSITIONS}")
        fields[name] = int(value) if name == "original_ctx" else float(value)
    scaling = RopeScaling(kind, **fields)
    if scaling.type == "none" or (scaling.type == "linear" and scaling.factor == 1.0):
        return NONE
    if scaling.factor <= 0:
        raise GGUFError(f"{gf.path}: {prefix}.rope.scaling.factor = {scaling.factor}, expected a positive number")
    return scaling if scaling.original_ctx else replace(scaling, original_ctx=ctx_train)


def _longrope(gf, prefix: str, ctx_train: int) -> RopeScaling:
    """Phi-3's LongRoPE, as llama.cpp's converter stores it: the two factor tensors, the original
    context and the attention factor sqrt(1 + ln(s) / ln(original)) it computed."""
    missing = [t for t in LONGROPE_TENSORS if t not in gf.tensors]
    if missing:
        raise GGUFError(f"{gf.path}: LongRoPE model without {', '.join(missing)}; expected both factor tensors")
    original = gf.value(f"{prefix}.rope.scaling.original_context_length", "integer") or ctx_train
    attn_factor = gf.value(f"{prefix}.rope.scaling.attn_factor", "number", 1.0)
    if not (0 < original <= MAX_POSITIONS and attn_factor > 0):
        raise GGUFError(f"{gf.path}: LongRoPE original context {original} / attn_factor {attn_factor}, "
                        f"expected a positive integer and a positive number")
    return RopeScaling("longrope", max(1.0, ctx_train / original), int(original), float(attn_factor))


def freq_factors(gf, scaling: RopeScaling, n_ctx: int) -> np.ndarray | None:
    """The per-pair divisors of inv_freq a file stores: rope_freqs.weight (Llama 3), or LongRoPE's
    long factors when the context exceeds the original one and its short factors otherwise
    (llama.cpp: llama_model::get_rope_factors). None when the file has none."""
    if "rope_freqs.weight" in gf.tensors:
        return gf.dequantize("rope_freqs.weight").astype(np.float64)
    if scaling.type == "longrope":
        name = LONGROPE_TENSORS[0] if n_ctx > scaling.original_ctx else LONGROPE_TENSORS[1]
        return gf.dequantize(name).astype(np.float64)
    return None


def requested(kind: str | None, factor: float | None) -> RopeScaling | None:
    """The scaling a user asks for (`--rope-scaling TYPE --rope-scale S`); None when nothing is asked.
    Its original context is left 0: load_config fills in the file's context_length."""
    if kind is None and factor is None:
        return None
    if kind is None:
        kind = "linear"
    choices = [t for t in TYPES if t != "longrope"]  # LongRoPE needs the model's own factor tensors
    if kind not in choices:
        raise ParameterError(f"--rope-scaling {kind!r}, expected one of {', '.join(choices)}")
    if kind == "none":
        return NONE
    if factor is None:
        raise ParameterError(f"--rope-scaling {kind} needs --rope-scale S (the context extension factor)")
    if not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1:
        raise ParameterError(f"--rope-scale {factor!r}, expected a number >= 1")
    return RopeScaling(kind, float(factor))


def warn_beyond_training(config, n_ctx: int) -> None:
    """A context longer than the model was trained for, with no scaling declared or asked for: say
    what would help (outputs usually degrade past the trained context)."""
    if n_ctx > config.ctx_train and not config.rope_scaling.active:
        factor = math.ceil(n_ctx / config.ctx_train)
        log.warning("context of %d positions is beyond the %d the model was trained for and it declares no RoPE "
                    "scaling; consider --rope-scaling yarn --rope-scale %d", n_ctx, config.ctx_train, factor)


def llama3_freq_factors(rope_dim: int, base: float, s: RopeScaling) -> np.ndarray:
    """Per-pair divisors of inv_freq for Llama 3.1+ (what llama.cpp stores as rope_freqs.weight).

    https://github.com/meta-llama/llama-models/blob/main/models/llama3/reference_impl/model.py
    (apply_scaling): long wavelengths are divided by factor, short ones kept, a smooth blend between.
    """
    inv = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    wavelen = 2 * math.pi / inv
    low_wavelen = s.original_ctx / s.low_freq_factor
    high_wavelen = s.original_ctx / s.high_freq_factor
    smooth = (s.original_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = 1.0 / ((1 - smooth) / s.factor + smooth)
    factors = np.where(wavelen > low_wavelen, s.factor, blended)
    return np.where(wavelen < high_wavelen, 1.0, factors)


def yarn_corr_dims(rope_dim: int, base: float, s: RopeScaling) -> tuple[float, float]:
    """The pair indices where YaRN's ramp starts and ends (llama.cpp ggml_rope_yarn_corr_dims)."""
    def dim(rotations: float) -> float:
        return rope_dim * math.log(s.original_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(dim(s.beta_fast)))
    high = min(rope_dim - 1.0, math.ceil(dim(s.beta_slow)))
    return low, high


def inv_frequencies(rope_dim: int, base: float, scaling: RopeScaling = NONE,
                    freq_factors: np.ndarray | None = None) -> np.ndarray:
    """float64 (rope_dim // 2,) angles per position of each rotated pair."""
    i = np.arange(rope_dim // 2, dtype=np.float64)
    inv = base ** (-2.0 * i / rope_dim)
    if freq_factors is not None:  # the file's rope_freqs.weight (Llama 3): applied whatever the type
        inv = inv / np.asarray(freq_factors, dtype=np.float64)
    elif scaling.type == "llama3":
        inv = inv / llama3_freq_factors(rope_dim, base, scaling)
    if scaling.type == "linear":
        inv = inv / scaling.factor
    elif scaling.type == "yarn":
        low, high = yarn_corr_dims(rope_dim, base, scaling)
        ramp = np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
        keep = (1.0 - ramp) * scaling.ext_factor  # 1: original frequency, 0: interpolated
        inv = inv / scaling.factor * (1.0 - keep) + inv * keep
    return inv


def mscale(scaling: RopeScaling) -> float:
    """The multiplier of the rotated Q and K values (so attention logits grow by mscale^2)."""
    if scaling.type == "longrope":
        return scaling.attn_factor
    if scaling.type != "yarn" or scaling.ext_factor == 0:
        return 1.0
    grow = 1.0 + 0.1 * math.log(scaling.factor) if scaling.factor > 1 else 1.0
    return scaling.attn_factor * grow


def cos_sin(positions: np.ndarray, rope_dim: int, base: float, scaling: RopeScaling = NONE,
            freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float64 cos and sin (times mscale) of every (position, pair): (n_pos, rope_dim // 2) each."""
    theta = np.outer(np.asarray(positions, dtype=np.float64), inv_frequencies(rope_dim, base, scaling, freq_factors))
    m = mscale(scaling)
    return np.cos(theta) * m, np.sin(theta) * m
