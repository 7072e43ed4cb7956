"""What a WebGPU adapter costs and reaches, measured with GPU timestamps: the streaming read, the
per-dispatch and per-submit overheads, the arithmetic ceiling (FMA chains in f32 and f16), the
prefill GEMM per quant type, and the decode matmuls against the streaming read. Each part prints a
table; --json writes every number.

    python dev/webgpu/probe.py [--parts stream,overhead,fma,gemm,gemv] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import numpy as np
import wgpu

from airframe.gpu import pipelines as K
from airframe.gpu.bench import GpuTimer, warm_up
from airframe.gpu.device import get_context
from airframe.gpu.pack import relayout
from airframe.quantize import quantize
from airframe.quants import quant as gpu_quant


def run_passes(ctx, timer: GpuTimer, dispatches, repeats: int, passes: int) -> list[float]:
    """GPU seconds per repetition of `dispatches` (a list of K.Dispatch) in each of `passes` passes
    of `repeats` repetitions."""
    for _ in range(passes):
        enc = ctx.device.create_command_encoder()
        K.record(enc, dispatches * repeats, timer.writes())
        ctx.device.queue.submit([enc.finish()])
    return [t / repeats for t in timer.read()]


# ---- streaming read --------------------------------------------------------------------------
def stream(ctx, timer) -> dict:
    kern = K.Pipelines(ctx, matmul="tiled")
    n_bytes = min(1 << 30, ctx.max_binding, ctx.max_buffer) // 16 * 16
    src = kern.storage(n_bytes, "src")
    out = kern.storage(256 * 1024 * 4, "out")
    rows = []
    for threads in (64 * 1024, 256 * 1024, 1024 * 1024):
        params = kern.uniform(K.pack_params("stream_read", n_vec4=n_bytes // 16, n_threads=threads))
        d = K.Dispatch("s", kern.pipeline("stream_read"), kern.bind("stream_read", [src, out, params]),
                       (threads // 256, 1, 1))
        if threads > 256 * 1024:
            out2 = kern.storage(threads * 4, "out2")
            d.bind_group = kern.bind("stream_read", [src, out2, params])
        warm_up(ctx, timer, [d])
        times = run_passes(ctx, timer, [d], 5, 20)
        tbs = sorted(n_bytes / t / 1e12 for t in times)
        rows.append({"threads": threads, "min": tbs[0], "median": statistics.median(tbs), "max": tbs[-1]})
        print(f"stream {threads:>8} threads: TB/s min {tbs[0]:.2f} median {statistics.median(tbs):.2f} max {tbs[-1]:.2f}")
    return {"bytes": n_bytes, "rows": rows}


# ---- overheads -------------------------------------------------------------------------------
TINY = """
struct Imm { v: u32, pad0: u32, pad1: u32, pad2: u32 }
var<immediate> I: Imm;
@group(0) @binding(0) var<storage, read_write> B: array<u32>;
@group(0) @binding(1) var<uniform> U: vec4<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) { B[g.x] = B[g.x] + 1u + U.x + I.v; }
"""


def overhead(ctx, timer) -> dict:
    dev = ctx.device
    module = dev.create_shader_module(code=TINY)
    bgl = dev.create_bind_group_layout(entries=[
        {"binding": 0, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": "storage"}},
        {"binding": 1, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": "uniform"}}])
    layout = dev.create_pipeline_layout(bind_group_layouts=[bgl], immediate_size=16)
    pipe = dev.create_compute_pipeline(layout=layout, compute={"module": module, "entry_point": "main"})
    uni = dev.create_buffer(size=16, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
    bufs = [dev.create_buffer(size=64 * 1024 * 4, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
            for _ in range(100)]
    groups = [dev.create_bind_group(layout=bgl, entries=[
        {"binding": 0, "resource": {"buffer": b}}, {"binding": 1, "resource": {"buffer": uni}}]) for b in bufs]
    imm = np.zeros(4, np.uint32)
    out = {}

    def one_pass(n, same, wg=1):
        enc = dev.create_command_encoder()
        cp = enc.begin_compute_pass(timestamp_writes=timer.writes())
        cp.set_pipeline(pipe)
        for i in range(n):
            cp.set_bind_group(0, groups[0 if same else i % 100])
            cp.set_immediates(0, imm, 0, 16)
            cp.dispatch_workgroups(wg)
        cp.end()
        dev.queue.submit([enc.finish()])

    module2 = dev.create_shader_module(code=TINY + "\n// another program\n")
    pipe2 = dev.create_compute_pipeline(layout=layout, compute={"module": module2, "entry_point": "main"})
    for _ in range(3):
        enc = dev.create_command_encoder()
        cp = enc.begin_compute_pass(timestamp_writes=timer.writes())
        for i in range(100):
            cp.set_pipeline(pipe if i % 2 else pipe2)
            cp.set_bind_group(0, groups[0])
            cp.set_immediates(0, imm, 0, 16)
            cp.dispatch_workgroups(132)
        cp.end()
        dev.queue.submit([enc.finish()])
    out["dispatch_us_alternating_pipelines"] = statistics.median(timer.read()) / 100 * 1e6
    print(f"dispatch_us_alternating_pipelines (132 wg): {out['dispatch_us_alternating_pipelines']:.2f}")
    for same in (True, False):
        for wg in (1, 132):
            for _ in range(3):
                one_pass(100, same, wg)
            timer.read()
            for _ in range(10):
                one_pass(100, same, wg)
            per = statistics.median(timer.read()) / 100 * 1e6
            key = f"dispatch_us_{'same' if same else 'distinct'}_buffer_{wg}wg"
            out[key] = per
            print(f"{key}: {per:.2f}")

    # a "token" of 90 dependent dispatches: per token one command buffer with a uniform write,
    # one with immediates only, or every token in one pass
    def token(cp, t):
        cp.set_pipeline(pipe)
        imm[0] = t
        for i in range(90):
            cp.set_bind_group(0, groups[0])
            cp.set_immediates(0, imm, 0, 16)
            cp.dispatch_workgroups(4)

    def token_cbs(n_tokens, write_uniform):
        cbs = []
        for t in range(n_tokens):
            enc = dev.create_command_encoder()
            cp = enc.begin_compute_pass()
            token(cp, t)
            cp.end()
            cbs.append(enc.finish())
        started = time.perf_counter()
        for t, cb in enumerate(cbs):
            if write_uniform:
                dev.queue.write_buffer(uni, 0, np.array([t, 0, 0, 0], np.uint32))
            dev.queue.submit([cb])
        dev.queue.read_buffer(bufs[0], 0, 16)
        return (time.perf_counter() - started) / n_tokens

    def tokens_one_pass(n_tokens):
        enc = dev.create_command_encoder()
        cp = enc.begin_compute_pass()
        for t in range(n_tokens):
            token(cp, t)
        cp.end()
        cb = enc.finish()
        started = time.perf_counter()
        dev.queue.submit([cb])
        dev.queue.read_buffer(bufs[0], 0, 16)
        return (time.perf_counter() - started) / n_tokens

    for name, fn in (("token_cb_uniform_write", lambda: token_cbs(64, True)),
                     ("token_cb_immediates", lambda: token_cbs(64, False)),
                     ("tokens_one_pass", lambda: tokens_one_pass(64))):
        fn()
        ms = 1000 * statistics.median(fn() for _ in range(5))
        out[f"{name}_ms"] = ms
        print(f"{name}: {ms:.3f} ms per 90-dispatch token")
    # host: recording 90 dispatches
    started = time.perf_counter()
    for _ in range(20):
        enc = dev.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        for i in range(90):
            cp.set_bind_group(0, groups[i % 100])
            cp.set_immediates(0, imm, 0, 16)
            cp.dispatch_workgroups(4)
        cp.end()
        enc.finish()
    out["record_90_ms"] = 1000 * (time.perf_counter() - started) / 20
    print(f"recording 90 dispatches (wgpu-py calls): {out['record_90_ms']:.3f} ms")
    return out


# ---- arithmetic ceiling ---------------------------------------------------------------------
FMA_CHAINS, FMA_STEPS = 16, 2048  # independent accumulators per invocation, steps of each


def chains_source(init: str, operands: str, step: str, advance: str, result: str, header: str = "") -> str:
    """A kernel of FMA_CHAINS independent chains a{i} per invocation (`init` and `step` are formats
    of i), FMA_STEPS steps each; `advance` changes an operand every step so nothing is hoisted, and
    `result` (of `total`, the chains' sum) goes to Y."""
    inits = "\n".join("    " + init.format(i=i) for i in range(FMA_CHAINS))
    steps = "\n".join("        " + step.format(i=i) for i in range(FMA_CHAINS))
    total = " + ".join(f"a{i}" for i in range(FMA_CHAINS))
    return f"""{header}
@group(0) @binding(0) var<storage, read_write> Y: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(global_invocation_id) gid: vec3<u32>) {{
{inits}
{operands}
    for (var k = 0u; k < {FMA_STEPS}u; k++) {{
{steps}
        {advance}
    }}
    Y[gid.x] = {result.format(total=total)};
}}
"""


def fma_source(kind: str, width: int, form: str = "fma") -> str:
    """fma chains on vec<width> of `kind`, written as fma() or (form "muladd") as a * m + c, which a
    driver may compile differently."""
    vec = f"vec{width}<{kind}>"
    return chains_source(f"var a{{i}} = {vec}({kind}(lid.x + {{i}}u) * {kind}(1e-3));",
                         f"    var m = {vec}({kind}(0.999));\n    let c = {vec}({kind}(1e-4));",
                         "a{i} = fma(a{i}, m, c);" if form == "fma" else "a{i} = a{i} * m + c;",
                         f"m = m * {kind}(1.0);", f"f32(dot({{total}}, {vec}({kind}(1.0))))",
                         "enable f16;" if kind == "f16" else "")


def dot4_source() -> str:
    """i32 chains of dot4I8Packed sums."""
    return chains_source("var a{i} = i32(lid.x + {i}u);", "    var m = lid.x * 0x01030507u;\n    let c = 0x02040608u;",
                         "a{i} += dot4I8Packed(m + {i}u, c);", "m += 1u;", "f32({total})")


def fma(ctx, timer) -> dict:
    """TFLOP/s of independent fma chains (2 FLOP each), vec4 and vec2, f32 and (with shader-f16) f16,
    and TOP/s of dot4I8Packed chains (8 operations each): the ceilings a kernel's arithmetic can reach
    through this compiler and driver."""
    dev = ctx.device
    n_groups = 16 * 132
    y = dev.create_buffer(size=n_groups * 256 * 4, usage=wgpu.BufferUsage.STORAGE)
    kinds = ["f32"] + (["f16"] if "shader-f16" in ctx.features else [])
    cases = [(f"{form:6} {kind} vec{width}", fma_source(kind, width, form), width * 2)
             for kind, width, form in itertools.product(kinds, (4, 2), ("fma", "muladd"))]
    cases.append(("dot4I8Packed", dot4_source(), 8))
    rows = []
    for name, code, ops in cases:
        pipe = dev.create_compute_pipeline(layout="auto", compute={"module": dev.create_shader_module(code=code),
                                                                   "entry_point": "main"})
        group = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[{"binding": 0, "resource": {"buffer": y}}])
        d = K.Dispatch(name, pipe, group, (n_groups, 1, 1))
        warm_up(ctx, timer, [d], 0.2)
        t = statistics.median(run_passes(ctx, timer, [d], 4, 5))
        tops = n_groups * 256 * FMA_STEPS * FMA_CHAINS * ops / t / 1e12
        print(f"{name}: {tops:6.1f} T operations/s ({t * 1e3:.2f} ms a dispatch)")
        rows.append({"case": " ".join(name.split()), "tops": tops})
    return {"rows": rows}


# ---- prefill GEMM ----------------------------------------------------------------------------
def _weights(kern, qtype, rows, cols, rng):
    values = rng.normal(0, 0.02, (rows, cols)).astype(np.float32)
    raw = quantize(values, qtype)
    words = relayout(raw, qtype)
    buf = kern.storage(words.nbytes + cols * 4, "w")
    kern.device.queue.write_buffer(buf, 0, words)
    norm = (1 + 0.1 * rng.normal(size=cols)).astype(np.float32)
    kern.device.queue.write_buffer(buf, words.nbytes, norm)
    from airframe.gguf_file import dequantize_rows
    return buf, words.shape[1], words.size, dequantize_rows(raw, qtype).reshape(rows, cols), norm


def gemm_dispatch(kern, qtype, buf, row_words, rows, cols, x, y, step, n_tokens, mode=0, w1=0, norm_w=0,
                  x_stride=None, program="gemm", splits=1):
    quant = gpu_quant(qtype)
    out_rows = rows // 2 if mode & K.MODE_GATED else rows
    params = K.pack_params("gemm", rows=out_rows, cols=cols, row_words=row_words, mode=mode, w0=0, w1=w1, w2=0,
                           seg1=K.NO_SEGMENT, seg2=K.NO_SEGMENT, norm_w=norm_w, eps=1e-5,
                           x_stride=x_stride or cols, y_stride=out_rows, y_off=0, row_words2=row_words, xq_off=0)
    group = kern.bind("gemm", [buf, x, y, kern.uniform(params), step])
    grid = (kern.gemm_groups(out_rows, bool(mode & K.MODE_GATED)), K.ceil_div(n_tokens, K.GEMM_TILE_TOKENS), splits)
    return K.Dispatch(program, kern.pipeline(program, quant), group, grid)


def split_sum_dispatch(kern, part, y, step, rows, n_tokens, splits):
    params = K.pack_params("split_sum", rows=rows, splits=splits, y_stride=rows, y_off=0, accumulate=0)
    group = kern.bind("split_sum", [part, y, kern.uniform(params), step])
    return K.Dispatch("split_sum", kern.pipeline("split_sum"), group, (K.ceil_div(rows, 256), n_tokens, 1))


def gemm(ctx, timer, types, speed: bool = True, programs=("gemm",), splits=(1,)) -> dict:
    kern = K.Pipelines(ctx, matmul="tiled")
    rng = np.random.default_rng(0)
    results = []
    # correctness on an odd shape: rows not a multiple of the tile, tokens not of 64, gating
    for program, qtype in [(p, q) for p in programs for q in types]:
        rows, cols, n_tok = 200, 512, 77
        buf, rw, n_words, w, _ = _weights(kern, qtype, 2 * rows, cols, rng)
        xv = rng.normal(size=(n_tok, cols)).astype(np.float32)
        x = kern.storage(xv.nbytes, "x")
        ctx.device.queue.write_buffer(x, 0, xv)
        y = kern.storage(n_tok * rows * 4 * 2, "y")
        step = kern.uniform(K.pack_step(0, n_tok))
        checks = {}
        for name, mode in (("plain", 0), ("gated", K.MODE_GATED)):
            d = gemm_dispatch(kern, qtype, buf, rw, 2 * rows, cols, x, y, step, n_tok, mode,
                              w1=rows * rw, norm_w=n_words, program=program)
            enc = ctx.device.create_command_encoder()
            K.record(enc, [d])
            ctx.device.queue.submit([enc.finish()])
            out_rows = rows if mode & K.MODE_GATED else 2 * rows
            got = np.frombuffer(ctx.device.queue.read_buffer(y, 0, n_tok * out_rows * 4), np.float32).reshape(n_tok, out_rows)
            want = xv.astype(np.float64) @ w.astype(np.float64).T
            if mode & K.MODE_GATED:
                g, u = want[:, :rows], want[:, rows:]
                want = g / (1 + np.exp(-g)) * u
            err = float(np.abs(got - want).max() / np.abs(want).max())
            checks[name] = err
        print(f"{program} check {qtype.name:5}: " + ", ".join(f"{k} {v:.1e}" for k, v in checks.items()))
        results.append({"check": True, "program": program, "qtype": qtype.name, "errors": checks})
    if not speed:
        return {"rows": results}
    n_tok = 512
    shapes = {"wo": (2048, 2048, 0), "gate_up": (16384, 2048, K.MODE_GATED), "down": (2048, 8192, 0),
              "qkv": (3072, 2048, 0)}
    for qtype in types:
        for name, (rows, cols, mode) in shapes.items():
            buf, rw, n_words, _, _ = _weights(kern, qtype, rows, cols, rng)
            x = kern.storage(n_tok * cols * 4, "x")
            ctx.device.queue.write_buffer(x, 0, rng.normal(size=(n_tok, cols)).astype(np.float32))
            y = kern.storage(max(splits) * n_tok * rows * 4, "y")
            y_sum = kern.storage(n_tok * rows * 4, "y_sum")
            step = kern.uniform(K.pack_step(0, n_tok))
            for program, z in itertools.product(programs, splits):
                if z > 1 and mode & K.MODE_GATED:
                    continue
                ds = [gemm_dispatch(kern, qtype, buf, rw, rows, cols, x, y, step, n_tok, mode,
                                    w1=rows // 2 * rw, norm_w=n_words, program=program, splits=z)]
                if z > 1:  # the partials' sum is part of a split's cost
                    ds.append(split_sum_dispatch(kern, y, y_sum, step, rows, n_tok, z))
                warm_up(ctx, timer, ds, 0.25)
                t = statistics.median(run_passes(ctx, timer, ds, 5, 5))
                tflops = 2 * rows * cols * n_tok / t / 1e12
                label = program if z == 1 else f"{program}/{z}"
                print(f"{label:8} {qtype.name:5} {name:8} {rows}x{cols}x{n_tok}: {t * 1e6:8.1f} us  "
                      f"{tflops:5.1f} TFLOP/s")
                results.append({"program": program, "splits": z, "qtype": qtype.name, "shape": name,
                                "us": t * 1e6, "tflops": tflops})
    return {"rows": results}


# ---- decode matmuls --------------------------------------------------------------------------
COLD_BYTES = 256 << 20  # weights a gemv is timed over: five times an H100's or H200's L2 (50 MB)
MATCHED_THREADS = (16 * 1024, 64 * 1024, 256 * 1024)  # grids of the same-size streaming read


def cold_copies(kern, n_bytes: int, label: str) -> list:
    """Copies of an n_bytes buffer enough to overflow L2, to be read in turn, so each dispatch reads
    from memory as in a token's pass (the values do not change the speed)."""
    return [kern.storage(n_bytes, label) for _ in range(max(1, -(-COLD_BYTES // n_bytes)))]


def matched_stream(ctx, timer, kern, n_bytes: int) -> float:
    """Seconds of stream_read.wgsl over n_bytes timed as a gemv is (one dispatch after another, over
    cold copies): the least over MATCHED_THREADS grids. A matrix's read can be no faster, so its
    share of this one says how far the gemv is from what a dispatch of that size can stream."""
    srcs = cold_copies(kern, n_bytes, "src")
    best = float("inf")
    for threads in MATCHED_THREADS:
        out = kern.storage(threads * 4, "out")
        params = kern.uniform(K.pack_params("stream_read", n_vec4=n_bytes // 16, n_threads=threads))
        ds = [K.Dispatch("s", kern.pipeline("stream_read"), kern.bind("stream_read", [src, out, params]),
                         (threads // 256, 1, 1)) for src in srcs]
        best = min(best, time_in_turn(ctx, timer, ds))
    return best


def time_in_turn(ctx, timer, ds: list) -> float:
    """Seconds of one dispatch of `ds` (the same work over cold copies), taken in turn: the median
    of 5 passes after a warm-up."""
    warm_up(ctx, timer, ds, 0.1)
    return statistics.median(run_passes(ctx, timer, ds, max(1, 20 // len(ds)), 5)) / len(ds)


def gemv(ctx, timer, types, bandwidth, units=(), token_counts=(1,)) -> dict:
    kern = K.Pipelines(ctx, matmul="tiled")
    shapes = {"qkv": (3072, 2048), "wo": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
              "lm_head": (128256, 2048)}
    rows_out = []
    matched = {}  # bytes: seconds of the same-size streaming read
    for qtype, n_tok, (name, (rows, cols)) in itertools.product(types, token_counts, shapes.items()):
        quant = gpu_quant(qtype)
        row_words = quant.gpu_row_words(cols)
        w_bytes = rows * row_words * 4
        bufs = cold_copies(kern, w_bytes, "w")
        if w_bytes not in matched:
            matched[w_bytes] = matched_stream(ctx, timer, kern, w_bytes)
        x = kern.storage(n_tok * cols * 4, "x")
        y = kern.storage(n_tok * rows * 4, "y")
        step = kern.uniform(K.pack_step(0, n_tok))
        params = K.pack_params("gemv", rows=rows, cols=cols, row_words=row_words, mode=0, w0=0, w1=0, w2=0,
                               seg1=K.NO_SEGMENT, seg2=K.NO_SEGMENT, norm_w=0, eps=1e-5, x_stride=cols,
                               y_stride=rows, y_off=0, row_words2=row_words, xq_off=0)
        # ffn_down's 8-bit units read x as the gate/up gemv stored it (layer._down_x_stored)
        stored = name == "down" and bool(K.shader_constant(f"gemv/{quant.shader}.wgsl", "INT8_X"))
        rows_wg, shape = kern.decode_matmul(rows, cols, quant, n_tok, x_stored=stored)
        uniform = kern.uniform(params)
        groups = [kern.bind("gemv", [buf, x, y, uniform, step]) for buf in bufs]
        others = [u for u in units if u.startswith(quant.shader) and u != shape["GEMV_UNIT"]]
        for unit in [shape["GEMV_UNIT"]] + others:
            shader = "gemv/" + unit
            wg = rows_wg if unit == shape["GEMV_UNIT"] else kern.gemv_rows(rows, cols, unit)
            pipeline = kern.pipeline("gemv", quant, kern.gemv_shape(unit, wg, shape["GEMV_TOKENS"], cols, 0, stored))
            grid = (K.ceil_div(rows, wg), K.ceil_div(n_tok, shape["GEMV_TOKENS"]), 1)
            ds = [K.Dispatch(name, pipeline, group, grid) for group in groups]
            t = time_in_turn(ctx, timer, ds)
            share = w_bytes / t / bandwidth
            print(f"gemv {qtype.name:5} {name:8} {rows}x{cols} {n_tok} tokens: {t * 1e6:7.1f} us  "
                  f"{100 * share:5.1f}% of stream, {100 * matched[w_bytes] / t:5.1f}% of the same bytes' "
                  f"read ({1e6 * matched[w_bytes]:.1f} us; {shader}, {wg} rows)")
            rows_out.append({"qtype": qtype.name, "shape": name, "tokens": n_tok, "us": t * 1e6, "share": share,
                             "matched_us": matched[w_bytes] * 1e6, "matched_share": matched[w_bytes] / t,
                             "shader": shader})
    return {"rows": rows_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="stream,gemm,gemv")
    ap.add_argument("--programs", default="gemm", help="gemm programs to compare: gemm and any shaders/gemm_*.wgsl beside it")
    ap.add_argument("--types", default="BF16,Q8_0,Q4_K,Q6_K")
    ap.add_argument("--units", default="", help="gemv: other unit files of a type to compare (shaders/gemv/*.wgsl)")
    ap.add_argument("--tokens", default="1", help="gemv: tokens per dispatch to time, e.g. 1,8 (a batch of conversations)")
    ap.add_argument("--splits", default="1", help="gemm: workgroups along K to time, e.g. 1,2,3 (with split_sum.wgsl)")
    ap.add_argument("--check-only", action="store_true", help="gemm: only the correctness checks")
    ap.add_argument("--json")
    args = ap.parse_args()
    from gguf import GGMLQuantizationType as T
    types = [T[n] for n in args.types.split(",")]
    ctx = get_context()
    print(ctx.name, sorted(ctx.features))
    if not ctx.has_timestamps:
        raise SystemExit(f"{ctx.name} has no timestamp-query: the probe times passes on the GPU")
    timer = GpuTimer(ctx, n_passes=256)
    out = {"adapter": ctx.name}
    parts = args.parts.split(",")
    bandwidth = 3.5e12
    if "stream" in parts:
        out["stream"] = stream(ctx, timer)
        bandwidth = max(r["median"] for r in out["stream"]["rows"]) * 1e12
    if "overhead" in parts:
        out["overhead"] = overhead(ctx, timer)
    if "fma" in parts:
        out["fma"] = fma(ctx, timer)
    if "gemm" in parts:
        out["gemm"] = gemm(ctx, timer, types, speed=not args.check_only, programs=args.programs.split(","),
                          splits=[int(n) for n in args.splits.split(",")])
    if "gemv" in parts:
        out["gemv"] = gemv(ctx, timer, types, bandwidth, [u for u in args.units.split(",") if u],
                           [int(n) for n in args.tokens.split(",")])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
