"""Compute pipelines, their parameter structs and bind groups, and recording them into a pass.

Each shader in `shaders/` declares a uniform `Params` struct whose fields are listed here in the
same order (PARAMS), then its bindings in a fixed order (inputs, output, params, step); SIGNATURES
gives the binding kinds in that order so the Python side declares exactly what the WGSL does.
Pipelines share explicit bind-group layouts, so one bind group serves gemv.wgsl and gemm.wgsl alike.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import wgpu

from ..errors import ParameterError
from .quant_layout import GpuQuant
from .shaders import load_wgsl

R, RW, U = "read-only-storage", "storage", "uniform"  # binding kinds

PARAMS = {
    "gemv": ("rows", "cols", "row_words", "mode", "w0", "w1", "w2", "seg1", "seg2", "norm_w", "eps",
             "x_stride", "y_stride", "y_off"),
    "rope": ("n_head", "n_head_kv", "head_dim", "rope_dim", "neox", "qk_norm", "q_norm_w", "k_norm_w",
             "eps", "qkv_stride", "n_ctx", "table", "qkv_bias", "q_bias", "k_bias", "v_bias"),
    "attention_decode": ("n_head", "n_head_kv", "head_dim", "n_ctx", "window", "scale", "qkv_stride", "softcap"),
    "attention_merge": ("n_head", "head_dim"),
    "rmsnorm": ("n", "norm_w", "eps", "add", "x_stride", "y_stride"),
    "embedding": ("first_row", "n_rows", "cols", "row_words", "scale"),
    "stream_read": ("n_vec4", "n_threads"),
    "argmax": ("n", "n_groups", "ring_len"),
}
# Typed decode matmuls, gemv_<quant shader>.wgsl, per quant shader: (weights per invocation's unit, largest
# workgroup). A workgroup has one invocation per unit of a row (a power of two, at least 32, at most the
# largest) and makes TYPED_ROWS output rows (fixed in the shaders: gemv_common.wgsl). The largest
# workgroups are the best measured on the H200 (docs/BENCHMARKS.md, session 3): 128 for the K-quants
# (ffn_down's 8,192 columns: 2 units per invocation), 256 for Q8_0 and BF16.
TYPED_GEMV = {"q4_k": (32, 128), "q6_k": (32, 128), "q8_0": (16, 256), "bf16": (16, 256)}
TYPED_ROWS = 4
PARAMS["gemm"] = PARAMS["gemm_rows"] = PARAMS["gemv_chunk"] = PARAMS["gemv"]
PARAMS.update({f"gemv_{name}": PARAMS["gemv"] for name in TYPED_GEMV})
FLOAT_FIELDS = {"eps", "scale", "softcap"}
# fields a family switch turns on: 0 (off) unless given
OPTIONAL_FIELDS = {"qkv_bias": 0, "q_bias": 0, "k_bias": 0, "v_bias": 0, "softcap": 0.0}

SIGNATURES = {
    "gemv": (R, R, RW, U, U),               # W, X, Y, params, step
    "gemv_chunk": (R, R, RW, U, U),
    "gemm": (R, R, RW, U, U),
    "gemm_rows": (R, R, RW, U, U),
    "rope": (R, R, RW, RW, U, U),           # W, angle table, QKV, KV cache, params, step
    # QKV, layer W, RoPE table, KV cache, partials, output (one split), params, RoPE params, step
    "attention_decode": (R, R, R, RW, RW, RW, U, U, U),
    "attention_merge": (R, RW, U, U),       # partials, output, params, step
    "rmsnorm": (R, R, RW, U, U),            # W, X, Y, params, step
    "embedding": (R, R, RW, U, U),          # W (a row chunk), token ids, Y, params, step
    "stream_read": (R, RW, U),              # source, sums, params (bench.py's bandwidth probe)
    "argmax": (R, RW, RW, RW, U, U),        # logits, candidates, token ids, id ring, params, step
}
SIGNATURES.update({f"gemv_{name}": SIGNATURES["gemv"] for name in TYPED_GEMV})

# P.mode bits of gemv.wgsl / gemm.wgsl (activation.wgsl)
MODE_NORM, MODE_ACCUMULATE, MODE_GATED, MODE_GELU, MODE_X_STEP = 1, 2, 4, 8, 16
NO_SEGMENT = 0xFFFFFFFF
GEMV_WG, GEMV_ROWS = 256, 4        # gemv.wgsl default workgroup (best of 32x2, 64x4, 128x4, 256x4 on the H200)
# Which decode matmul (AIRFRAME_GEMV_KIND): "typed" gemv_<type>.wgsl for the types in TYPED_GEMV (rows of a
# whole number of units), gemv.wgsl for the others; "vec4" gemv.wgsl everywhere, "chunk"
# gemv_chunk.wgsl everywhere; "chunked-head" (the previous default) gemv_chunk.wgsl for matrices of
# CHUNK_MIN_ROWS rows or more in a type with its own chunk_dot, else gemv.wgsl. "auto" is typed: on the H200
# it was faster than the others on every matrix of Llama 3.2 1B in Q4_K_M, Q8_0 and BF16.
GEMV_KINDS = ("auto", "typed", "chunked-head", "chunk", "vec4")
GEMV_KIND = "auto"
CHUNK_MIN_ROWS = 32768
# gemv_chunk.wgsl per quant shader: (chunk_dot file, vec4 per chunk, invocations per workgroup); the
# workgroup sizes are the best measured on the H200 LM head (q4_k: not measured, as q6_k)
CHUNK_DOTS = {"q4_k": ("chunk_q4_k", 16, 32), "q6_k": ("chunk_q6_k", 8, 32), "q8_0": ("chunk_q8_0", 8, 64)}
GENERIC_CHUNK = ("chunk_generic", 8, 32)
GEMM_ROWS, GEMM_TOKENS, GEMM_K = 64, 64, 32  # tile of gemm.wgsl
ROWS_WG, ROWS_TOKENS = 256, 8     # gemm_rows.wgsl: rows per workgroup (64 x 4), tokens per invocation
STEP_BYTES = 16                    # struct Step: n_past, n_tokens, lm_first, split_len


def pack_params(shader: str, **values) -> bytes:
    """The shader's Params struct as bytes, fields in declaration order, padded to 16 bytes."""
    names = PARAMS[shader]
    values = {**{n: v for n, v in OPTIONAL_FIELDS.items() if n in names}, **values}
    unknown = set(values) - set(names)
    missing = set(names) - set(values)
    assert not unknown and not missing, f"{shader} params: unknown {unknown}, missing {missing}"
    out = b"".join(struct.pack("<f" if n in FLOAT_FIELDS else "<I", values[n]) for n in names)
    return out + bytes(-len(out) % 16)


def pack_step(n_past: int, n_tokens: int, lm_first: int = 0, split_len: int = 256) -> bytes:
    return struct.pack("<4I", n_past, n_tokens, lm_first, split_len)


@dataclass
class Dispatch:
    """One recorded dispatch: which program, which buffers, how many workgroups."""

    label: str
    pipeline: object
    bind_group: object
    workgroups: tuple[int, int, int]
    output: tuple | None = None  # (buffer, floats) written, for SHIMMY_DEBUG_RAW


@dataclass
class Kernels:
    """Pipelines (cached by shader and quant type), layouts and small helpers for one device."""

    ctx: object
    # "rows" (gemm_rows.wgsl for every token count: CPU adapters) or "tiled" (gemv.wgsl / gemm.wgsl)
    matmul: str = ""
    # "subgroup" or "shared": how gemv.wgsl reduces its partial sums (reduce_<name>.wgsl)
    reduce: str = ""
    # gemv.wgsl's workgroup: invocations and output rows (AIRFRAME_GEMV="64,4")
    gemv_wg: int = 0
    gemv_rows: int = 0
    # one of GEMV_KINDS: see GEMV_KIND
    gemv_kind: str = ""
    # gemv_chunk.wgsl's invocations per workgroup; 0: CHUNK_DOTS' choice for the quant type
    chunk_wg: int = 0
    # the typed kernels' largest workgroup; 0: TYPED_GEMV's per type
    typed_wg: int = 0
    _pipelines: dict = field(default_factory=dict)
    _layouts: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.matmul:
            cpu = self.ctx.adapter.info.get("adapter_type", "").upper() == "CPU"
            self.matmul = os.environ.get("AIRFRAME_MATMUL", "rows" if cpu else "tiled")
        if not self.reduce:
            default = "subgroup" if self.ctx.has_subgroups else "shared"
            self.reduce = os.environ.get("AIRFRAME_REDUCE", default)
        if self.reduce not in ("subgroup", "shared"):
            raise ParameterError(f"AIRFRAME_REDUCE={self.reduce!r}, expected 'subgroup' or 'shared'")
        if not self.gemv_wg:
            text = os.environ.get("AIRFRAME_GEMV", f"{GEMV_WG},{GEMV_ROWS}")
            try:
                self.gemv_wg, self.gemv_rows = (int(v) for v in text.split(","))
            except ValueError:
                raise ParameterError(f"AIRFRAME_GEMV={text!r}, expected 'invocations,rows' such as '64,4'") from None
        if self.gemv_wg not in (32, 64, 128, 256) or self.gemv_rows not in (1, 2, 3, 4):
            raise ParameterError(f"gemv workgroup {self.gemv_wg} x {self.gemv_rows} rows, expected 32/64/128/256 "
                                 f"invocations and 1..4 rows")
        if not self.gemv_kind:
            self.gemv_kind = os.environ.get("AIRFRAME_GEMV_KIND", GEMV_KIND)
        if self.gemv_kind not in GEMV_KINDS:
            raise ParameterError(f"AIRFRAME_GEMV_KIND={self.gemv_kind!r}, expected one of {', '.join(GEMV_KINDS)}")
        if self.typed_wg not in (0, 32, 64, 128, 256):
            raise ParameterError(f"typed gemv workgroup of {self.typed_wg} invocations, expected 32/64/128/256 (0: default)")
        if self.chunk_wg not in (0, 32, 64, 128, 256):
            raise ParameterError(f"gemv_chunk workgroup of {self.chunk_wg} invocations, expected 32/64/128/256")
        if self.matmul not in ("rows", "tiled"):
            raise ParameterError(f"AIRFRAME_MATMUL={self.matmul!r}, expected 'rows' or 'tiled'")

    @property
    def device(self):
        return self.ctx.device

    def layout(self, shader: str):
        kinds = SIGNATURES[shader]
        if kinds not in self._layouts:
            entries = [{"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": kind}}
                       for i, kind in enumerate(kinds)]
            self._layouts[kinds] = self.device.create_bind_group_layout(entries=entries)
        return self._layouts[kinds]

    def decode_matmul(self, rows: int, cols: int, quant: GpuQuant) -> tuple[str, int, dict | None]:
        """The one-token matmul program for a (rows, cols) matrix in `quant`: (shader, output rows per
        workgroup, its placeholder values or None for the defaults)."""
        name = quant.shader.removesuffix(".wgsl")
        unit, max_wg = TYPED_GEMV.get(name, (1, 0))
        if self.gemv_kind in ("auto", "typed") and name in TYPED_GEMV and cols % unit == 0:
            wg = min(self.typed_wg or max_wg, max(32, 1 << (cols // unit - 1).bit_length()))
            return f"gemv_{name}", TYPED_ROWS, {"GEMV_WG": wg}
        chunked = self.gemv_kind == "chunk" or (self.gemv_kind == "chunked-head" and name in CHUNK_DOTS
                                                and rows >= CHUNK_MIN_ROWS)
        return "gemv_chunk" if chunked else "gemv", self.gemv_rows, None

    def pipeline(self, shader: str, quant: GpuQuant | None = None, shape: dict | None = None):
        """The compute pipeline of `shader` for `quant`; `shape` fills the program's model-shape
        placeholders (attention_defines)."""
        if shader == "gemv" and self.gemv_kind == "chunk":
            shader = "gemv_chunk"
        key = (shader, quant.shader if quant else None, tuple(sorted((shape or {}).items())))
        if key not in self._pipelines:
            defines = {"REDUCE": self.reduce, "GEMV_WG": str(self.gemv_wg), "GEMV_ROWS": str(self.gemv_rows),
                       **{name: str(value) for name, value in (shape or {}).items()}}
            if quant:
                defines["QUANT"] = quant.shader.removesuffix(".wgsl")
            if shader == "gemv_chunk":
                dot_file, chunk, wg = CHUNK_DOTS.get(defines["QUANT"], GENERIC_CHUNK)
                defines.update(CHUNK_DOT=dot_file, CHUNK=str(chunk), GEMV_WG=str(self.chunk_wg or wg))
            source = load_wgsl(f"{shader}.wgsl", defines)
            module = self.device.create_shader_module(label=f"{shader}/{key[1]}", code=source)
            layout = self.device.create_pipeline_layout(bind_group_layouts=[self.layout(shader)])
            self._pipelines[key] = self.device.create_compute_pipeline(
                label=f"{shader}/{key[1]}", layout=layout, compute={"module": module, "entry_point": "main"})
        return self._pipelines[key]

    def uniform(self, data: bytes, label: str = "params"):
        buffer = self.device.create_buffer(label=label, size=max(len(data), 16),
                                           usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        self.device.queue.write_buffer(buffer, 0, data)
        return buffer

    def bind(self, shader: str, resources: list):
        """A bind group for `shader`: each resource is a buffer or (buffer, byte offset, byte size)."""
        entries = []
        for i, res in enumerate(resources):
            if isinstance(res, tuple):
                buffer, offset, size = res
                entries.append({"binding": i, "resource": {"buffer": buffer, "offset": offset, "size": size}})
            else:
                entries.append({"binding": i, "resource": {"buffer": res, "offset": 0, "size": res.size}})
        return self.device.create_bind_group(layout=self.layout(shader), entries=entries)

    def storage(self, n_bytes: int, label: str, readable: bool = False):
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        return self.device.create_buffer(label=label, size=max(int(n_bytes), 16), usage=usage)


def attention_defines(n_head: int, n_head_kv: int, head_dim: int) -> dict:
    """attention_decode.wgsl's shape placeholders: query heads per K/V head, head size, and the
    sizes derived from them (its workgroup is 64 invocations)."""
    group, dims = n_head // n_head_kv, ceil_div(head_dim, 64)
    return {"ATTN_GROUP": group, "ATTN_HEAD_DIM": head_dim, "ATTN_DIMS": dims, "ATTN_Q": group * head_dim,
            "ATTN_ACC": group * dims}


def _raw_lib():
    """wgpu-native's cffi functions, which wgpu-py itself calls: recording through them skips
    wgpu-py's per-call wrapper (NOTES-KERNELS.md: about half the CPU time of a token)."""
    if os.environ.get("AIRFRAME_RAW_RECORD", "1") != "1":
        return None
    try:
        from wgpu.backends.wgpu_native import _api
        return _api.lib, _api.ffi.NULL
    except (ImportError, AttributeError):
        return None


_RAW = _raw_lib()


def record(encoder, dispatches: list[Dispatch]) -> None:
    """All dispatches in one compute pass."""
    compute = encoder.begin_compute_pass()
    if _RAW is None:
        for d in dispatches:
            compute.set_pipeline(d.pipeline)
            compute.set_bind_group(0, d.bind_group)
            compute.dispatch_workgroups(*d.workgroups)
    else:
        lib, null = _RAW
        handle = compute._internal
        last = None
        for d in dispatches:
            if d.pipeline is not last:
                lib.wgpuComputePassEncoderSetPipeline(handle, d.pipeline._internal)
                last = d.pipeline
            lib.wgpuComputePassEncoderSetBindGroup(handle, 0, d.bind_group._internal, 0, null)
            x, y, z = d.workgroups
            lib.wgpuComputePassEncoderDispatchWorkgroups(handle, x, y, z)
    compute.end()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


Grid = Callable[[int, int], tuple[int, int, int]]


def run_once(kernels: Kernels, shader: str, quant: GpuQuant | None, resources: list,
             grid: tuple[int, int, int], shape: dict | None = None) -> list:
    """Run one dispatch on fresh buffers (tests, debugging): numpy arrays become storage buffers,
    bytes become uniforms, in binding order. Returns the writable bindings read back, as their dtypes."""
    device = kernels.device
    buffers, written = [], []
    for kind, res in zip(SIGNATURES[shader], resources):
        if kind == U:
            buffers.append(kernels.uniform(bytes(res)))
            continue
        data = np.ascontiguousarray(res)
        buffer = kernels.storage(max(data.nbytes, 16), "run_once")
        device.queue.write_buffer(buffer, 0, data)
        buffers.append(buffer)
        if kind == RW:
            written.append((buffer, data))
    group = kernels.bind(shader, buffers)
    encoder = device.create_command_encoder()
    record(encoder, [Dispatch(shader, kernels.pipeline(shader, quant, shape), group, grid)])
    device.queue.submit([encoder.finish()])
    return [np.frombuffer(device.queue.read_buffer(b, 0, d.nbytes), dtype=d.dtype).reshape(d.shape)
            for b, d in written]
