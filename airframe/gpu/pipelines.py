"""Compute pipelines from `shaders/`, their parameter blocks and bind groups, and recording them.

A shader's binding list and its `struct Params` are read from its WGSL source (`signature`), so the
Python side keeps no copy of either: `pack_params` packs the fields in the order and with the types
the shader declares, and a bind group takes its layout from the binding kinds. Programs with the
same binding kinds share one layout, so one bind group serves gemv.wgsl, gemm.wgsl and
gemm_rows.wgsl alike.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import wgpu

from ..errors import UnsupportedError
from ..options import MATMULS, REDUCES, check_choice
from ..quants import QuantType
from .shaders import load_wgsl

R, RW, U = "read-only-storage", "storage", "uniform"  # binding kinds

# Placeholder values that let any program be read for its signature: the bindings and Params of a
# program do not depend on them (tests/test_gpu_pipelines.py checks every variant).
SIGNATURE_DEFINES = {"QUANT": "f32", "GEMV_UNIT": "f32", "REDUCE": "shared", "DECODER": "quant/f32.wgsl",
                     "HALF": "f32"}
_BINDING = re.compile(r"@group\(0\)\s*@binding\((\d+)\)\s*var<(\w+)(?:,\s*(\w+))?>")
_PARAMS_TYPE = re.compile(r"var<uniform>\s+P\s*:\s*(\w+)\s*;")
_FIELD = re.compile(r"(\w+)\s*:\s*(u32|f32|i32)")
_CONST = re.compile(r"const (\w+): u32 = (\d+)u;")
_FORMATS = {"u32": "<I", "i32": "<i", "f32": "<f"}


@dataclass(frozen=True)
class Signature:
    kinds: tuple[str, ...]                # binding kinds, in binding order
    params: tuple[tuple[str, str], ...]   # (field, WGSL type) of struct Params, in order


def _any_value(name: str) -> str:
    """A placeholder's value for reading a signature: every numeric placeholder reads as 1."""
    return SIGNATURE_DEFINES.get(name, "1")


def read_signature(source: str, where: str = "shader") -> Signature:
    """The binding kinds and the Params fields of a program's expanded WGSL source."""
    bindings = sorted((int(i), space, access) for i, space, access in _BINDING.findall(source))
    if [b[0] for b in bindings] != list(range(len(bindings))):
        raise AssertionError(f"{where}: bindings {[b[0] for b in bindings]} are not 0..n-1")
    kinds = tuple(U if space == "uniform" else RW if access == "read_write" else R
                  for _, space, access in bindings)
    params: tuple = ()
    if found := _PARAMS_TYPE.search(source):  # the struct of the uniform P
        body = re.search(r"struct " + found.group(1) + r"\s*\{([^}]*)\}", source)
        params = tuple(_FIELD.findall(body.group(1)))
    return Signature(kinds, params)


@lru_cache(maxsize=None)
def signature(shader: str) -> Signature:
    """`shader`'s signature, read from its source with placeholders that do not change it."""
    return read_signature(load_wgsl(f"{shader}.wgsl", default=_any_value), f"{shader}.wgsl")


@lru_cache(maxsize=None)
def shader_constant(file: str, name: str) -> int:
    """A `const NAME: u32 = Nu;` of a WGSL file, so Python and the shaders share one value."""
    for key, value in _CONST.findall(load_wgsl(file, default=_any_value)):
        if key == name:
            return int(value)
    raise KeyError(f"{file} declares no u32 constant {name}")


# P.mode bits of the matmul programs (activation.wgsl)
MODE_NORM, MODE_ACCUMULATE, MODE_GATED, MODE_GELU, MODE_X_STEP, MODE_ROUND_OUT = (
    shader_constant("activation.wgsl", name)
    for name in ("MODE_NORM", "MODE_ACCUMULATE", "MODE_GATED", "MODE_GELU", "MODE_X_STEP", "MODE_ROUND_OUT"))
NO_SEGMENT = 0xFFFFFFFF
GEMM_K = 32             # gemm.wgsl's step over the input columns (KSTEP)
GEMM_TILE_ROWS, GEMM_TILE_TOKENS = 128, 64  # gemm.wgsl's tile
SPLIT_ROW_TILES = 32    # row tiles x 8 token tiles of a 512-token chunk below FULL_GPU: split along K
SPLIT_COLS = 2048       # input columns each part of a third K-split sums at least
TINY_ROW_TILES = 4      # a matrix of this many row tiles or fewer (Q4_K_M's V beside Q and K) takes 4 K-splits
WAVE = 132              # workgroups a large GPU runs at once, one per SM (H200: 132 SMs)
FULL_GPU = 2 * WAVE     # workgroups that fill a large GPU twice over
LANES, SUBGROUPS = 32, 8  # gemv.wgsl's workgroup as most GPUs run it: 8 subgroups of 32
GEMV_TOKENS = 8         # tokens a forward takes through gemv.wgsl at most (a decode batch); more: gemm.wgsl
GEMV_TALLER = 4         # a batch's gemv workgroups take up to this many times one token's rows,
GEMV_BATCH_GRID = 256   # while their grid keeps this many: about two per SM (2 * WAVE kept the 1B
                        # shape's gate/up and ffn_down at 8 streams half as tall, 3.04 against 2.95 ms)
GEMV_GROUP = 4          # gemv.wgsl's tokens per workgroup at most; a batch of 8 is two groups along y
GEMV_WG = 256           # gemv.wgsl's invocations per workgroup
XBLOCK_GRAIN = 16       # gemv/x_int8.wgsl stages x in runs of 16 blocks of 16 (a K-quant block)
STAGE_ROWS_WG = 16      # gemv/x_int8.wgsl stages x in workgroups of this many rows or more
STAGED_BLOCK_BYTES = 32  # a staged or stored block of 16 rounded values: 16 int8 and 4 floats
ROWS_WG, ROWS_TOKENS = 256, 8  # gemm_rows.wgsl: rows per workgroup (64 x 4), tokens per invocation at most
STEP_BYTES = 16         # struct Step: n_past, n_tokens, lm_first, split_len
ROW_BYTES = 16          # struct DecodeRow (decode_rows.wgsl): kv, n_past, split_len, part


def rows_tokens(n_tokens: int) -> int:
    """gemm_rows.wgsl's tokens per invocation for a forward of n_tokens: a decode batch of fewer than
    ROWS_TOKENS costs its own tokens, not a whole tile's."""
    return min(n_tokens, ROWS_TOKENS)


def pack_params(shader: str, **values) -> bytes:
    """The shader's Params struct as bytes, fields in declaration order, padded to 16 bytes."""
    names, packer = _params_layout(shader)
    if values.keys() != names:
        raise AssertionError(f"{shader} params: unknown {set(values) - names}, missing {names - set(values)}")
    return packer.pack(*(values[name] for name in names))


@lru_cache(maxsize=None)
def _params_layout(shader: str) -> tuple:
    """The Params field names (in order, as dict keys) and their packing, padded to 16 bytes."""
    fields = signature(shader).params
    size = sum(struct.calcsize(_FORMATS[kind]) for _, kind in fields)
    layout = "<" + "".join(_FORMATS[kind].lstrip("<") for _, kind in fields) + f"{-size % 16}x"
    return dict.fromkeys(name for name, _ in fields).keys(), struct.Struct(layout)


def rope_groups(qkv_stride: int, groups: list[tuple[int, int]] = ()) -> dict:
    """rope.wgsl's Params fields saying where QKV's columns lie: `groups` (first column, K-splits)
    per QKV matmul whose K-split partials rope.wgsl sums itself; none: all in QKV."""
    starts = [start for start, _ in groups[1:]] + [qkv_stride] * (3 - max(len(groups), 1))
    splits = [n for _, n in groups] + [0] * (3 - len(groups))
    return dict(splits0=splits[0], splits1=splits[1], splits2=splits[2], start1=starts[0], start2=starts[1])


def pack_step(n_past: int, n_tokens: int, lm_first: int = 0, split_len: int = 256) -> bytes:
    return struct.pack("<4I", n_past, n_tokens, lm_first, split_len)


def pack_rows(rows: list[tuple[int, int, int, int]]) -> bytes:
    """DecodeRow entries (decode_rows.wgsl): (first vec4 of the slot's cache, n_past, split_len,
    first float of the row's partials) per decode token."""
    return np.asarray(rows, np.uint32).reshape(-1, ROW_BYTES // 4).tobytes()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Dispatch:
    """One recorded dispatch: which program, which buffers, how many workgroups."""

    label: str
    pipeline: object
    bind_group: object
    workgroups: tuple[int, int, int]
    output: tuple | None = None  # (buffer, floats) written, for SHIMMY_DEBUG_RAW


@dataclass
class Pipelines:
    """Pipelines (cached by shader, quant type and placeholders), layouts and helpers for one device.

    matmul: "rows" (gemm_rows.wgsl for every token count: CPU adapters, whose invocations are SIMD
    lanes) or "tiled" (gemv.wgsl for one token, gemm.wgsl for chunks); "auto" picks by adapter.
    reduce: "subgroup" or "shared", how gemv.wgsl adds across lanes; "auto" picks by feature.
    """

    ctx: object
    matmul: str = "auto"
    reduce: str = "auto"
    _pipelines: dict = field(default_factory=dict)
    _layouts: dict = field(default_factory=dict)

    def __post_init__(self):
        check_choice("matmul", self.matmul, MATMULS)
        check_choice("reduce", self.reduce, REDUCES)
        if self.matmul == "auto":
            cpu = self.ctx.adapter.info.get("adapter_type", "").upper() == "CPU"
            self.matmul = "rows" if cpu else "tiled"
        if self.reduce == "auto":
            self.reduce = "subgroup" if self.ctx.has_subgroups else "shared"

    @property
    def device(self):
        return self.ctx.device

    @property
    def half(self) -> str:
        """The type chunks sum their products in (gemm.wgsl, attention_prefill.wgsl): f16 for the
        tiled programs where the adapter has shader-f16, f32 for gemm_rows.wgsl's CPU adapters."""
        return "f16" if self.matmul == "tiled" and self.ctx.has_f16 else "f32"

    def layout(self, shader: str):
        kinds = signature(shader).kinds
        if kinds not in self._layouts:
            entries = [{"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": kind}}
                       for i, kind in enumerate(kinds)]
            self._layouts[kinds] = self.device.create_bind_group_layout(entries=entries)
        return self._layouts[kinds]

    def decode_matmul(self, rows: int, cols: int, quant: QuantType, n_tokens: int = 1,
                      unit: str | None = None, mode: int = 0, x_stored: bool = False) -> tuple[int, dict]:
        """gemv.wgsl for a (rows, cols) matrix in `quant` and n_tokens (at most GEMV_TOKENS) tokens, in
        workgroups of up to gemv_group tokens along y (their placeholder GEMV_TOKENS): (output rows
        per workgroup, its placeholders), with `unit` (shaders/gemv/<unit>.wgsl), else the type's own,
        for an op of `mode` (its P.mode), reading x rounded by the gemv before where x_stored. A
        batch's workgroups take up to GEMV_TALLER times one token's rows while their grid keeps
        GEMV_BATCH_GRID workgroups, each row's units split between subgroups as one token's are
        (Q4_K_M, a step of 8 streams 2.95 against 3.21 GPU ms, H100: gate/up, ffn_down and the LM
        head read each weight for more tokens at once)."""
        name = unit or quant.shader
        one = self.gemv_rows(rows, cols, name)
        group = min(n_tokens, self.gemv_group)
        rows_wg = one
        # a batch's workgroups grow while the grid, counting its token groups, still fills the GPU
        while n_tokens > 1 and rows_wg < GEMV_TALLER * one and \
                ceil_div(rows, 2 * rows_wg) * ceil_div(n_tokens, group) >= GEMV_BATCH_GRID:
            rows_wg *= 2
        return rows_wg, self.gemv_shape(name, rows_wg, group, cols, mode, x_stored, one)

    @staticmethod
    def gemv_rows(rows: int, cols: int, unit: str) -> int:
        """Output rows per gemv.wgsl workgroup with unit file gemv/<unit>.wgsl: the most that still
        make FULL_GPU workgroups (the subgroups then split each row's units between them), more
        where a row has too few units to keep them all busy, and two quads rather than one where one
        quad would leave each lane fewer than two units (Llama 3.2 1B's Q4_K ffn_down: 0.323 against
        0.392 GPU ms a token, H100)."""
        units = cols // shader_constant(f"gemv/{unit}.wgsl", "UNIT")
        lanes_per_row = ceil_div(units, LANES)  # subgroups a row's units keep busy
        rows_wg = next((r for r in (32, 16, 8) if ceil_div(rows, r) >= FULL_GPU), 4)
        while rows_wg < 32 and 4 * SUBGROUPS // rows_wg > lanes_per_row:
            rows_wg *= 2
        if rows_wg == 4 and units < 2 * GEMV_WG:  # one quad's lanes would add one unit each
            rows_wg = 8
        return rows_wg

    def gemv_shape(self, unit: str, rows_wg: int, n_tokens: int, cols: int, mode: int = 0,
                   x_stored: bool = False, split_rows: int | None = None) -> dict:
        """gemv.wgsl's placeholders for unit file gemv/<unit>.wgsl and an op of `mode` (MODE, a
        constant, so the compiler leaves out the sums and registers that the mode does not use). An
        8-bit unit reads x as the gemv before stored it rounded where x_stored (MODE_ROUND_OUT);
        else its workgroup of STAGE_ROWS_WG rows or more rounds x into workgroup memory once for
        all its quads (gemv/x_int8.wgsl): the whole row where workgroup memory holds it, else as many
        blocks of 16 x per token at a time as it holds, in whole K-quant blocks (16 blocks of 16).
        `split_rows`: the rows of one token's workgroup, which the split of a row's units between
        subgroups is reckoned from (a batch's taller workgroups; default rows_wg)."""
        int8 = shader_constant(f"gemv/{unit}.wgsl", "INT8_X")
        assert not x_stored or int8, f"gemv/{unit}.wgsl reads x as floats, not rounded"
        assert not mode & MODE_ROUND_OUT or rows_wg % 16 == 0, f"{rows_wg} rows a workgroup cannot round blocks of 16"
        round_floats = n_tokens * rows_wg if mode & MODE_ROUND_OUT else 1
        stage, x_blocks = 0, 1
        if x_stored:
            stage = 2
        elif int8 and rows_wg >= STAGE_ROWS_WG:
            room = self.gemv_room - n_tokens * self.gemv_merge_bytes - 4 * round_floats
            fits = room // (n_tokens * STAGED_BLOCK_BYTES) // XBLOCK_GRAIN * XBLOCK_GRAIN
            stage, x_blocks = 1, max(XBLOCK_GRAIN, min(fits, ceil_div(cols, 16 * XBLOCK_GRAIN) * XBLOCK_GRAIN))
        return {"GEMV_ROWS_WG": rows_wg, "GEMV_UNIT": unit, "GEMV_TOKENS": n_tokens, "GEMV_MODE": mode,
                "GEMV_SUBGROUPS": self.gemv_subgroups, "GEMV_STAGE_X": stage, "GEMV_XBLOCKS": x_blocks,
                "GEMV_ROUND_FLOATS": round_floats, "GEMV_SPLIT_QUADS": (split_rows or rows_wg) // 4}

    @property
    def gemv_subgroups(self) -> int:
        """Subgroups a gemv.wgsl workgroup may have: lanes_shared.wgsl's runs of 32, or as many as
        the adapter's smallest subgroups make."""
        lanes = LANES if self.reduce == "shared" else max(1, min(LANES, self.ctx.min_subgroup_size))
        return GEMV_WG // lanes

    @property
    def gemv_merge_bytes(self) -> int:
        """gemv.wgsl's merge space per token: 3 vec4 of sums per subgroup (`partial`)."""
        return 48 * self.gemv_subgroups

    @property
    def gemv_room(self) -> int:
        """Bytes of workgroup memory a gemv.wgsl workgroup has for its merge space and staged x."""
        return int(self.ctx.limits["max-compute-workgroup-storage-size"]) - (16 * GEMV_WG if self.reduce == "shared" else 0)

    @property
    def gemv_tokens(self) -> int:
        """Tokens a forward takes through gemv.wgsl at most, in workgroups of gemv_group tokens."""
        return GEMV_TOKENS

    @property
    def gemv_group(self) -> int:
        """Tokens per gemv.wgsl workgroup: GEMV_GROUP, or fewer where their merge space and the least
        staged x exceed the workgroup memory left beside lanes_shared.wgsl's (gemv_room)."""
        per_token = self.gemv_merge_bytes + XBLOCK_GRAIN * STAGED_BLOCK_BYTES
        return max(1, min(GEMV_GROUP, self.gemv_room // per_token))

    def gemm_groups(self, rows: int, gated: bool) -> int:
        """gemm.wgsl's workgroups along the rows: tiles of 128 rows, or of 64 gate rows and their 64
        up rows."""
        return ceil_div(rows, GEMM_TILE_ROWS // 2 if gated else GEMM_TILE_ROWS)

    def gemm_splits(self, rows: int, cols: int, gated: bool) -> int:
        """gemm.wgsl's workgroups along K for a chunk's matrix (split_sum.wgsl adds the partials):
        for one of SPLIT_ROW_TILES row tiles or fewer (every matrix of a chunk but gate/up and the
        LM head) 2, or 3 where each part still sums SPLIT_COLS columns (ffn_down), 4 for one of
        TINY_ROW_TILES or fewer, else 1. Llama 3.2 1B, 512 tokens (docs/DECISIONS.md): 2 splits took
        the output projection from 4.92 to 3.98 ms a chunk (H200); ffn_down 667 us with 2, 628 with
        3, 690 with 4, the output projection and QKV fastest with 2 (H100, each with its sums); 4 for
        Q4_K_M's V (4 row tiles, beside Q and K) took its chunk from 42.20 to 41.92 ms."""
        tiles = self.gemm_groups(rows, gated)
        if self.half != "f16" or gated or tiles > SPLIT_ROW_TILES or cols % GEMM_K:
            return 1
        if tiles <= TINY_ROW_TILES:
            return min(4, cols // GEMM_K)
        return 3 if cols >= 3 * SPLIT_COLS else 2

    def pipeline(self, shader: str, quant: QuantType | None = None, shape: dict | None = None):
        """The compute pipeline of `shader` for `quant`, with `shape` filling the program's
        placeholders (model shape, tile sizes)."""
        key = (shader, quant.shader if quant else None, tuple(sorted((shape or {}).items())))
        if key not in self._pipelines:
            defines = {"REDUCE": self.reduce, "HALF": self.half,
                       **{name: str(value) for name, value in (shape or {}).items()}}
            if quant:
                defines["QUANT"] = quant.shader
            source = load_wgsl(f"{shader}.wgsl", defines)
            label = "/".join(str(k) for k in key[:2] if k)
            module = self.device.create_shader_module(label=label, code=source)
            layout = self.device.create_pipeline_layout(bind_group_layouts=[self.layout(shader)])
            self._pipelines[key] = self.device.create_compute_pipeline(
                label=label, layout=layout, compute={"module": module, "entry_point": "main"})
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
            buffer, offset, size = res if isinstance(res, tuple) else (res, 0, res.size)
            entries.append({"binding": i, "resource": {"buffer": buffer, "offset": offset, "size": size}})
        return self.device.create_bind_group(layout=self.layout(shader), entries=entries)

    def readback(self, n_bytes: int, label: str):
        """A MAP_READ buffer that results are copied into for the host (read_mapped)."""
        return self.device.create_buffer(label=label, size=max(int(n_bytes), 16),
                                         usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)

    def storage(self, n_bytes: int, label: str):
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        return self.device.create_buffer(label=label, size=max(int(n_bytes), 16), usage=usage)


def read_mapped(buffer, n_bytes: int, dtype) -> np.ndarray:
    """The first n_bytes of a `readback` buffer as a new array, once the GPU has written them."""
    buffer.map_sync(wgpu.MapMode.READ, 0, n_bytes)
    data = np.frombuffer(buffer.read_mapped(0, n_bytes, copy=True), dtype=dtype)
    buffer.unmap()
    return data


def submit(queue, command_buffers: list) -> int | None:
    """queue.submit, returning the submission's index for read_after (None without wgpu-native's
    functions)."""
    if _RAW is None:
        queue.submit(command_buffers)
        return None
    lib, ffi = _RAW
    handles = ffi.new("WGPUCommandBuffer[]", [c._internal for c in command_buffers])
    return int(lib.wgpuQueueSubmitForIndex(queue._internal, len(command_buffers), handles))


def write(queue, buffer, data) -> None:
    """queue.write_buffer at offset 0 of a whole bytes object or contiguous array, through
    wgpu-native's function where it can (half the host time of wgpu-py's checks, per token's writes)."""
    if _RAW is None:
        queue.write_buffer(buffer, 0, data)
        return
    lib, ffi = _RAW
    view = ffi.from_buffer(data)
    lib.wgpuQueueWriteBuffer(queue._internal, buffer._internal, 0, view, len(view))


def wait_done(device, index: int | None) -> None:
    """Return once submission `index` (submit()) has run, not waiting for the ones after it; with no
    index, once everything submitted has."""
    if _RAW is None:
        device.queue.on_submitted_work_done_sync()
        return
    lib, ffi = _RAW
    lib.wgpuDevicePoll(device._internal, True, ffi.NULL if index is None else ffi.new("WGPUSubmissionIndex *", index))


def read_after(device, buffer, n_bytes: int, dtype, index: int | None) -> np.ndarray:
    """read_mapped of a buffer that submission `index` (submit()) wrote, once that submission is
    done and not the ones after it: wgpu-py's maps wait for every submission, which would idle the
    GPU between a chain's steps. With no index, read_mapped."""
    if index is None or _RAW is None:
        return read_mapped(buffer, n_bytes, dtype)
    wait_done(device, index)
    lib, ffi = _RAW
    mapped = _map_callback()
    status = mapped.status
    status.clear()
    info = ffi.new("WGPUBufferMapCallbackInfo *", {"mode": lib.WGPUCallbackMode_AllowProcessEvents,
                                                   "callback": mapped.callback})
    lib.wgpuBufferMapAsync(buffer._internal, lib.WGPUMapMode_Read, 0, n_bytes, info[0])
    while not status:  # the copy is done: the first poll completes the map
        lib.wgpuDevicePoll(device._internal, False, ffi.NULL)
    if status[0] != lib.WGPUMapAsyncStatus_Success:
        raise RuntimeError(f"could not map {buffer.label!r} for reading (status {status[0]})")
    data = np.frombuffer(ffi.buffer(lib.wgpuBufferGetConstMappedRange(buffer._internal, 0, n_bytes), n_bytes),
                         dtype=dtype).copy()
    lib.wgpuBufferUnmap(buffer._internal)
    return data


class _MapCallback:
    """read_after's map callback, made once (a cffi callback costs more to make than a read
    takes), and the statuses it reported."""

    def __init__(self):
        self.status: list[int] = []
        self.callback = _RAW[1].callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)",
                                         lambda result, *_: self.status.append(result))


@lru_cache(maxsize=None)
def _map_callback() -> _MapCallback:
    return _MapCallback()


def attention_shapes(n_head: int, n_head_kv: int, head_dim: int, workgroup_bytes: int,
                     half: str) -> tuple[dict, dict]:
    """The placeholders of attention_decode.wgsl and attention_prefill.wgsl for a model shape: the
    largest blocks whose workgroup memory (the sizes of their var<workgroup>) fits the adapter's;
    `half` is the prefill tiles' type (Pipelines.half)."""
    group, hd4 = n_head // n_head_kv, head_dim // 4
    slices = 128 // hd4
    fixed = 4 * ((group + 1) * (head_dim + 1) + head_dim + 8 * head_dim + 8 * 32 + 16 * slices * hd4) + 16 * 128
    block = next((b for b in (256, 128) if fixed + 32 * b <= workgroup_bytes), None)
    if block is None:
        raise UnsupportedError(f"{group} query heads of {head_dim} per K/V head need {fixed + 32 * 128:,} bytes of "
                               f"workgroup memory in attention_decode.wgsl; the adapter has {workgroup_bytes:,}")
    # 64-key tiles in `half`: Q and K chunks (16 dims x 64), P (64 keys x 64 rows), V (64 x 64 dims);
    # the f32 row exchange
    tile = 2 if half == "f16" else 4
    keys = 64 if tile * (16 * 64 + 16 * 64 + 2 * 64 * 64) + 4 * 1024 <= workgroup_bytes else 32
    decode = {"ATTN_GROUP": group, "ATTN_HEAD_DIM": head_dim, "ATTN_BLOCK": block}
    prefill = {"ATTN_GROUP": group, "ATTN_HEAD_DIM": head_dim, "ATTN_KEYS": keys}
    return decode, prefill


def _raw_lib():
    """wgpu-native's cffi functions and ffi, which wgpu-py itself calls: recording through them
    skips wgpu-py's per-call wrapper (about half the host time of a token)."""
    try:
        from wgpu.backends.wgpu_native import _api
        return _api.lib, _api.ffi
    except (ImportError, AttributeError):
        return None


_RAW = _raw_lib()


def record(encoder, dispatches: list[Dispatch], timestamp_writes: dict | None = None) -> None:
    """All dispatches in one compute pass."""
    compute = encoder.begin_compute_pass(timestamp_writes=timestamp_writes)
    if _RAW is None:
        for d in dispatches:
            compute.set_pipeline(d.pipeline)
            compute.set_bind_group(0, d.bind_group)
            compute.dispatch_workgroups(*d.workgroups)
    else:
        lib, null = _RAW[0], _RAW[1].NULL
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


def run_once(pipes: Pipelines, shader: str, quant: QuantType | None, resources: list,
             grid: tuple[int, int, int], shape: dict | None = None) -> list:
    """Run one dispatch on fresh buffers (tests, debugging): numpy arrays become storage buffers,
    bytes become uniforms, in binding order. Returns the writable bindings read back, as their dtypes."""
    device = pipes.device
    buffers, written = [], []
    for kind, res in zip(signature(shader).kinds, resources):
        if kind == U:
            buffers.append(pipes.uniform(bytes(res)))
            continue
        data = np.ascontiguousarray(res)
        buffer = pipes.storage(max(data.nbytes, 16), "run_once")
        device.queue.write_buffer(buffer, 0, data)
        buffers.append(buffer)
        if kind == RW:
            written.append((buffer, data))
    group = pipes.bind(shader, buffers)
    encoder = device.create_command_encoder()
    record(encoder, [Dispatch(shader, pipes.pipeline(shader, quant, shape), group, grid)])
    device.queue.submit([encoder.finish()])
    return [np.frombuffer(device.queue.read_buffer(b, 0, d.nbytes), dtype=d.dtype).reshape(d.shape)
            for b, d in written]
