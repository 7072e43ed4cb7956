"""The numpy reference forward pass: the oracle every backend is checked against.

Clarity beats speed here. Weights are dequantized with the `gguf` package's numpy code, all math is
float32 (softmax included), one function per op. `ReferenceBackend` implements the Backend protocol
(airframe/backend.py) with an F32 K/V cache laid out like the GPU's: [layer][kv_head][ctx][head_dim].

Math per family follows llama.cpp's graphs (src/models/llama.cpp, gemma3.cpp) and HF transformers'
modeling files; the named switches of ModelConfig select the variant, never the architecture name.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from tqdm import tqdm

from .backend import Backend, check_tokens, default_context, kv_cache_bytes, slot_count
from .family import ModelConfig
from .gguf_file import GGUFFile
from .model import Model
from .options import RunOptions
from .rope_scaling import NONE as NO_ROPE_SCALING, RopeScaling, cos_sin, freq_factors


# ---- ops -------------------------------------------------------------------------------------
def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    x = x.astype(np.float32)
    mean_sq = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(mean_sq + np.float32(eps))) * weight


def rope_angles(positions: np.ndarray, rope_dim: int, base: float,
                freq_factors: np.ndarray | None = None) -> np.ndarray:
    """theta[p, i] = p * base^(-2i / rope_dim) (/ freq_factors[i]), shape (n_pos, rope_dim // 2)."""
    i = np.arange(rope_dim // 2, dtype=np.float64)
    inv_freq = base ** (-2.0 * i / rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    return np.outer(positions.astype(np.float64), inv_freq)


def rope(x: np.ndarray, positions: np.ndarray, rope_dim: int, base: float, style: str,
         freq_factors: np.ndarray | None = None, scaling: RopeScaling = NO_ROPE_SCALING) -> np.ndarray:
    """Rotate the first rope_dim dims of each head. x: (n_pos, n_heads, head_dim).

    "normal" pairs dims (2i, 2i+1) (GGUF llama, whose converter permuted Q/K for it);
    "neox" pairs dims (i, i + rope_dim/2). `scaling` (airframe/rope_scaling.py) changes the
    frequencies and, for YaRN, multiplies the rotated dims by mscale.
    """
    cos, sin = cos_sin(positions, rope_dim, base, scaling, freq_factors)  # (n_pos, rope_dim/2)
    cos = cos.astype(np.float32)[:, None, :]
    sin = sin.astype(np.float32)[:, None, :]
    out = x.copy()
    if style == "normal":
        a, b = x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]
        out[..., 0:rope_dim:2] = a * cos - b * sin
        out[..., 1:rope_dim:2] = a * sin + b * cos
    else:
        half = rope_dim // 2
        a, b = x[..., :half], x[..., half:rope_dim]
        out[..., :half] = a * cos - b * sin
        out[..., half:rope_dim] = a * sin + b * cos
    return out


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap): Gemma 2's soft-capping of attention scores and final logits."""
    return (np.float32(cap) * np.tanh(x / np.float32(cap))).astype(np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
              scale: float, window: int = 0, cap: float = 0.0) -> np.ndarray:
    """Causal grouped-query attention.

    q: (n_q_pos, n_head, hd); k, v: (n_kv_head, n_ctx, hd) holding positions 0..n_ctx-1.
    A query at position p sees keys at positions j <= p (and p - j < window when window > 0).
    cap > 0 soft-caps the scaled scores before the mask.
    Returns (n_q_pos, n_head, hd_v).
    """
    n_head, n_kv = q.shape[1], k.shape[0]
    group = n_head // n_kv
    key_pos = np.arange(k.shape[1])
    visible = key_pos[None, :] <= q_positions[:, None]
    if window:
        visible &= (q_positions[:, None] - key_pos[None, :]) < window
    out = np.empty((q.shape[0], n_head, v.shape[2]), dtype=np.float32)
    for h in range(n_head):
        kv = h // group
        scores = (q[:, h, :] @ k[kv].T) * np.float32(scale)  # (n_q_pos, n_ctx)
        if cap:
            scores = softcap(scores, cap)
        scores = np.where(visible, scores, -np.inf)
        scores = scores - scores.max(axis=1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=1, keepdims=True)
        out[:, h, :] = probs @ v[kv]
    return out


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) -> inf for very negative x gives the right limit, 0
        return x / (np.float32(1.0) + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(math.sqrt(2.0 / math.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


def gated_ffn(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, activation: str) -> np.ndarray:
    """down @ (act(gate @ x) * (up @ x)), row-major weights (out, in)."""
    return (ACTIVATIONS[activation](x @ gate.T) * (x @ up.T)) @ down.T


# ---- the model ---------------------------------------------------------------------------------
class ReferenceModel:
    """Dequantized float32 weights, loaded layer by layer on first use."""

    def __init__(self, gf: GGUFFile, config: ModelConfig):
        self.gf = gf
        self.config = config
        self._layers: dict[int, dict[str, np.ndarray]] = {}
        self.token_embd = gf.dequantize("token_embd.weight")  # (vocab, n_embd)
        self.output_norm = gf.dequantize("output_norm.weight")
        self.output = self.token_embd if config.tied_embeddings else gf.dequantize("output.weight")

    def layer(self, i: int) -> dict[str, np.ndarray]:
        if i not in self._layers:
            self._layers[i] = {name.removesuffix(".weight"): self.gf.dequantize(f"blk.{i}.{name}")
                               for name in self.config.layer_tensors}
        return self._layers[i]


class ReferenceBackend(Backend):
    """The numpy reference as a Backend: forward() over consecutive positions with a K/V cache."""

    name = "reference"
    keeps_prompt_cache = True  # positions below n_past are only ever overwritten by forward

    def __init__(self, model: ReferenceModel, n_ctx: int, n_slots: int = 1):
        self.model = model
        self.config = model.config
        self.n_ctx = n_ctx
        c = self.config
        # per-pair RoPE divisors: rope_freqs.weight, or LongRoPE's long/short factors for this n_ctx
        self.rope_freqs = freq_factors(model.gf, c.rope_scaling, n_ctx)
        # per slot: (layer, kv_head, ctx, head_dim), F32 like the GPU cache
        self.slot_caches = [(np.zeros((c.n_layers, c.n_head_kv, n_ctx, c.head_dim), dtype=np.float32),
                             np.zeros((c.n_layers, c.n_head_kv, n_ctx, c.head_dim_v), dtype=np.float32))
                            for _ in range(n_slots)]
        self.slot_past = [0] * n_slots  # each slot's n_past while another is selected
        self.n_slots = n_slots
        self.k_cache, self.v_cache = self.slot_caches[0]
        self.n_past = 0

    @classmethod
    def load(cls, model: Model, options: RunOptions) -> "ReferenceBackend":
        weights = ReferenceModel(model.gguf, model.config)
        for i in tqdm(range(model.config.n_layers), desc="dequantizing", disable=not options.progress, leave=False):
            weights.layer(i)
        backend = cls(weights, default_context(model.config, options), slot_count("reference", model.config, options))
        backend.prefill_chunk = options.prefill_chunk
        return backend

    def reset(self) -> None:
        self.n_past = 0
        self.k_cache[:] = 0
        self.v_cache[:] = 0

    def kv_memory(self) -> int:
        return kv_cache_bytes(self.config, self.n_ctx, self.n_slots)

    def _switch_slot(self, i: int) -> None:
        self.k_cache, self.v_cache = self.slot_caches[i]

    def forward(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        tokens = check_tokens(tokens, self.n_past, self.n_ctx, self.model.token_embd.shape[0])
        end = self.n_past + tokens.size
        c = self.config
        positions = np.arange(self.n_past, end)
        x = self.model.token_embd[tokens] * np.float32(c.embedding_scale())  # (n, n_embd)
        for i in range(c.n_layers):
            x = self._layer(i, x, positions)
        self.n_past = end
        if not all_logits:
            x = x[-1:]
        x = rmsnorm(x, self.model.output_norm, c.rms_eps)
        logits = (x @ self.model.output.T).astype(np.float32)
        if c.final_logit_softcap:
            logits = softcap(logits, c.final_logit_softcap)
        return logits if all_logits else logits[0]

    def _layer(self, i: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        c = self.config
        w = self.model.layer(i)
        n = x.shape[0]
        h = rmsnorm(x, w["attn_norm"], c.rms_eps)
        q, k, v = _qkv(w, h, c)
        q = q.reshape(n, c.n_head, c.head_dim)
        k = k.reshape(n, c.n_head_kv, c.head_dim)
        v = v.reshape(n, c.n_head_kv, c.head_dim_v)
        if c.qk_norm:
            q = rmsnorm(q, w["attn_q_norm"], c.rms_eps)
            k = rmsnorm(k, w["attn_k_norm"], c.rms_eps)
        base, scaling = c.layer_rope_base(i), c.layer_rope_scaling(i)
        q = rope(q, positions, c.rope_dim, base, c.rope_style, self.rope_freqs, scaling)
        k = rope(k, positions, c.rope_dim, base, c.rope_style, self.rope_freqs, scaling)
        self.k_cache[i][:, positions[0]:positions[-1] + 1] = k.transpose(1, 0, 2)
        self.v_cache[i][:, positions[0]:positions[-1] + 1] = v.transpose(1, 0, 2)
        end = positions[-1] + 1
        window = c.sliding_window if c.is_local_layer(i) else 0
        attn = attention(q, self.k_cache[i][:, :end], self.v_cache[i][:, :end], positions,
                         c.attention_scale(), window, c.attn_logit_softcap)
        o = attn.reshape(n, c.n_head * c.head_dim_v) @ w["attn_output"].T
        if c.post_norms:
            o = rmsnorm(o, w["post_attention_norm"], c.rms_eps)
        x = x + o
        h = rmsnorm(x, w["ffn_norm"], c.rms_eps)
        if c.fused_gate_up:  # ffn_up: (2 n_ff, n_embd), gate rows first
            gate, up = w["ffn_up"][:c.n_ff], w["ffn_up"][c.n_ff:]
        else:
            gate, up = w["ffn_gate"], w["ffn_up"]
        f = gated_ffn(h, gate, up, w["ffn_down"], c.activation)
        if c.post_norms:
            f = rmsnorm(f, w["post_ffw_norm"], c.rms_eps)
        return (x + f).astype(np.float32)


def _qkv(w: dict[str, np.ndarray], h: np.ndarray, c: ModelConfig) -> tuple[np.ndarray, ...]:
    """The Q, K and V projections of normed h: (n, n_q), (n, n_kv), (n, n_head_kv * head_dim_v)."""
    if c.fused_qkv:  # attn_qkv rows: Q, then K, then V
        qkv = h @ w["attn_qkv"].T
        q, k, v = np.split(qkv, [c.n_q, c.n_q + c.n_kv], axis=-1)
    else:
        q, k, v = h @ w["attn_q"].T, h @ w["attn_k"].T, h @ w["attn_v"].T
    if c.qkv_bias:
        q, k, v = q + w["attn_q.bias"], k + w["attn_k.bias"], v + w["attn_v.bias"]
    return q, k, v


def greedy(backend, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy continuation (argmax, lowest id among ties) of `prompt` for n tokens."""
    backend.reset()
    logits = backend.forward(prompt)
    out = []
    for _ in range(n):
        token = int(np.argmax(logits))
        out.append(token)
        logits = backend.forward([token])
    return out
