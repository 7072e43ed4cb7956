"""WebGPU measurements for `airframe bench`: prefill speed, decode ms/token at several contexts,
dispatches and bytes per token, and the share of the bandwidth floor measured in the same run."""

from __future__ import annotations

import statistics
import time

import numpy as np
from tqdm import tqdm

from ..model import open_model
from ..options import RunOptions
from . import kernels as K
from .device import get_context
from .greedy import chain
from .runtime import WebGPUBackend

PROBE_BYTES = 1 << 30
PROBE_THREADS = 256 * 1024


def streaming_bandwidth(ctx, repeats: int = 10) -> float:
    """Bytes/s of a coalesced streaming read (stream_read.wgsl), `repeats` dispatches in one pass."""
    kernels = K.Kernels(ctx)
    n_bytes = min(PROBE_BYTES, ctx.max_binding, ctx.max_buffer) // 16 * 16
    src = kernels.storage(n_bytes, "probe_src")
    out = kernels.storage(PROBE_THREADS * 4, "probe_out")
    params = kernels.uniform(K.pack_params("stream_read", n_vec4=n_bytes // 16, n_threads=PROBE_THREADS))
    group = kernels.bind("stream_read", [src, out, params])
    dispatch = K.Dispatch("stream_read", kernels.pipeline("stream_read"), group, (PROBE_THREADS // 256, 1, 1))
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        encoder = ctx.device.create_command_encoder()
        K.record(encoder, [dispatch] * repeats)
        ctx.device.queue.submit([encoder.finish()])
        ctx.device.queue.read_buffer(out, 0, 16)
        best = min(best, time.perf_counter() - started)
    return n_bytes * repeats / best


def weight_bytes_per_token(be: WebGPUBackend) -> int:
    """Bytes of weights one decode token reads: every layer buffer, the LM head, one embedding row."""
    layers = sum(p.n_words * 4 for p in be.layers)
    head = sum(c.size for c in be.output.chunks)
    return layers + head + be.token_embd.row_words * 4


def kv_bytes_per_token(be: WebGPUBackend, context: int) -> int:
    c = be.config
    return 2 * c.n_layers * c.n_head_kv * context * c.head_dim * 4


def _median_decode_ms(be: WebGPUBackend, context: int, steps: int, bar) -> float:
    be.reset()
    # the K/V cache's contents do not change the speed: start decoding at `context` directly
    be.n_past = context - 1
    be.forward([1])
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        be.forward([1])
        times.append(time.perf_counter() - started)
        bar.update(1)
    return 1000 * statistics.median(times)


def _chained_decode_ms(be: WebGPUBackend, context: int, steps: int, runs: int = 3) -> float:
    """ms/token of `steps` greedy tokens chained on the GPU (greedy.py) from position context - 1,
    the ids read back in batches: median of `runs` whole chains, each timed to its last id."""
    times = []
    for _ in range(runs):
        be.reset()
        be.n_past = context - 1
        started = time.perf_counter()
        for _ in chain(be, 1, steps):
            pass
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times) / steps


def _chained(be: WebGPUBackend, decode: list[dict], steps: int, bandwidth: float, weight_bytes: int) -> dict:
    """The greedy chain's numbers at each context of the per-token `decode` rows, next to them."""
    be.reset()
    ctx_list = [d["context"] for d in decode]
    chain_dispatches = {d["context"]: d["dispatches"] + len(be.argmax.dispatches) for d in decode}
    empty = _timed_submit(be, [], 1)
    out = {"batch": be.argmax.batch, "argmax_gpu_ms": 1000 * (_timed_submit(be, be.argmax.dispatches, 20) - empty) / 20,
           "decode": []}
    _chained_decode_ms(be, ctx_list[0], min(steps, 8), runs=1)  # warm-up: the argmax pipelines
    with tqdm(total=len(ctx_list), desc="chained decode", unit="ctx") as bar:
        for context in ctx_list:
            ms = _chained_decode_ms(be, context, steps)
            floor_ms = 1000 * (weight_bytes + kv_bytes_per_token(be, context)) / bandwidth
            out["decode"].append({"context": context, "ms_per_token": ms, "floor_ms": floor_ms,
                                  "floor_share": floor_ms / ms, "dispatches": chain_dispatches[context]})
            bar.update(1)
    be.reset()
    return out


def _record_ms(be: WebGPUBackend, repeats: int = 20) -> float:
    """CPU time to record one decode token's compute pass (median), without submitting it."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        encoder = be.ctx.device.create_command_encoder()
        K.record(encoder, be.dispatches(1) + be.globals_ops.final_norm(1) + be.globals_ops.lm_head(1))
        encoder.finish()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def _op_class(label: str) -> str:
    """blk.3.qkv@0 -> qkv; lm_head#1 -> lm_head."""
    return label.split(".")[-1].split("@")[0].split("#")[0]


def _timed_submit(be: WebGPUBackend, dispatches: list[K.Dispatch], repeats: int) -> float:
    """Seconds to run `dispatches` `repeats` times in one pass, submit to completion (best of 3)."""
    device = be.ctx.device
    best = float("inf")
    for _ in range(3):
        encoder = device.create_command_encoder()
        K.record(encoder, dispatches * repeats)
        commands = encoder.finish()
        started = time.perf_counter()
        device.queue.submit([commands])
        device.queue.read_buffer(be.scratch.ids, 0, 16)
        best = min(best, time.perf_counter() - started)
    return best


def gpu_breakdown(be: WebGPUBackend, context: int, repeats: int = 20) -> dict:
    """GPU ms of one decode token (its dispatches repeated in one pass), per op class and in all,
    and the round trip of an empty submit plus a 16-byte read-back. Leaves the cache dirty: reset after."""
    be.reset()
    be.n_past = context - 1
    be._write_step(1)
    be._write_head_step(1, 0)
    token = be.dispatches(1) + be.globals_ops.final_norm(1) + be.globals_ops.lm_head(1)
    empty = _timed_submit(be, [], 1)
    out = {"roundtrip_ms": 1000 * empty,
           "token_ms": 1000 * (_timed_submit(be, token, repeats) - empty) / repeats, "ops_ms": {}}
    for name in dict.fromkeys(_op_class(d.label) for d in token):
        ops = [d for d in token if _op_class(d.label) == name]
        out["ops_ms"][name] = 1000 * (_timed_submit(be, ops, repeats) - empty) / repeats
    be.reset()
    return out


def bench_webgpu(path, ctx_list: list[int], steps: int = 64, prefill_tokens: int = 512) -> dict:
    """All numbers of one run as a dict (see commands/bench.py for the fields)."""
    ctx = get_context()
    n_ctx = max(max(ctx_list) + steps + 1, prefill_tokens)
    be = WebGPUBackend.load(open_model(path), RunOptions.from_env(n_ctx=n_ctx, progress=True))
    bandwidth = streaming_bandwidth(ctx)
    result = {"backend": "webgpu", "adapter": ctx.name, "model": str(path), "bandwidth_GBps": bandwidth / 1e9,
              "dispatches_per_token": be.dispatch_count(1), "weight_bytes_per_token": weight_bytes_per_token(be),
              "matmul": be.kernels.matmul, "gemv_kind": be.kernels.gemv_kind, "decode": []}
    result["record_ms"] = _record_ms(be)
    result["gpu"] = {c: gpu_breakdown(be, c) for c in ctx_list}
    ids = list(np.random.default_rng(0).integers(0, be.config.vocab_size, prefill_tokens))
    be.forward(ids)  # warm-up: pipelines, caches
    be.reset()
    started = time.perf_counter()
    be.forward(ids)
    result["prefill_tokens_per_s"] = prefill_tokens / (time.perf_counter() - started)
    with tqdm(total=steps * len(ctx_list), desc="decode", unit="tok") as bar:
        for context in ctx_list:
            ms = _median_decode_ms(be, context, steps, bar)
            n_bytes = result["weight_bytes_per_token"] + kv_bytes_per_token(be, context)
            floor_ms = 1000 * n_bytes / bandwidth
            be.n_past = context - 1
            result["decode"].append({"context": context, "ms_per_token": ms, "bytes_per_token": n_bytes,
                                     "floor_ms": floor_ms, "floor_share": floor_ms / ms,
                                     "dispatches": be.dispatch_count(1)})
    try:  # the other numbers must survive a failure here
        result["chained"] = _chained(be, result["decode"], steps, bandwidth, result["weight_bytes_per_token"])
    except Exception as e:  # noqa: BLE001 - reported in the result instead
        result["chained_error"] = f"{type(e).__name__}: {e}"
    return result


def format_result(r: dict) -> str:
    head = []
    lines = [f"{r['backend']} on {r['adapter']} ({r['matmul']} matmuls, decode gemv {r.get('gemv_kind', '?')})",
             f"model: {r['model']}",
             f"streaming read: {r['bandwidth_GBps']:.1f} GB/s; dispatches per decode token: {r['dispatches_per_token']}; "
             f"recording them: {r['record_ms']:.3f} ms",
             f"prefill (512-token chunk): {r['prefill_tokens_per_s']:.1f} tokens/s",
             "decode, logits read back every token (the sampling path):",
             "context  ms/token  tokens/s  MB/token  floor ms  share of floor  dispatches"]
    for context, g in r.get("gpu", {}).items():
        ops = ", ".join(f"{k} {v:.3f}" for k, v in g["ops_ms"].items())
        head += [f"GPU time at context {context}: {g['token_ms']:.3f} ms/token (round trip {g['roundtrip_ms']:.3f} ms); "
                 f"per op class: {ops}"]
    for d in r["decode"]:
        lines.append(f"{d['context']:>7}  {d['ms_per_token']:8.3f}  {1000 / d['ms_per_token']:8.1f}  "
                     f"{d['bytes_per_token'] / 1e6:8.1f}  {d['floor_ms']:8.3f}  {100 * d['floor_share']:13.1f}%  "
                     f"{d.get('dispatches', '?'):>10}")
    return "\n".join(lines + _format_chained(r) + head)


def _format_chained(r: dict) -> list[str]:
    if "chained_error" in r:
        return [f"decode, greedy chained on the GPU: FAILED ({r['chained_error']})"]
    if "chained" not in r:
        return []
    c = r["chained"]
    lines = [f"decode, greedy chained on the GPU (argmax on the GPU, {c['argmax_gpu_ms']:.3f} ms; no logits read back; "
             f"ids read back every {c['batch']} tokens; median of 3 chains):",
             "context  ms/token  tokens/s  floor ms  share of floor  dispatches"]
    for d in c["decode"]:
        lines.append(f"{d['context']:>7}  {d['ms_per_token']:8.3f}  {1000 / d['ms_per_token']:8.1f}  "
                     f"{d['floor_ms']:8.3f}  {100 * d['floor_share']:13.1f}%  {d['dispatches']:>10}")
    return lines


def compare_gemv(path, variants: list[tuple[str, int, int]], ctx_list: list[int], steps: int = 32,
                 repeats: int = 20) -> dict:
    """Decode matmul variants on one loaded model: for each (kind, invocations, rows) of a
    K.GEMV_KINDS kind (for "typed": the largest workgroup, 0 for the default; rows are always 4),
    the GPU breakdown and median decode ms at each context, and the largest logit difference from
    the first variant over three tokens."""
    be = WebGPUBackend.load(open_model(path), RunOptions.from_env(n_ctx=max(ctx_list) + steps + 1, progress=True))
    out = {"adapter": be.ctx.name, "model": str(path), "variants": []}
    first = None
    for kind, wg, rows in variants:
        k = be.kernels
        k.gemv_kind = kind
        if kind == "typed":
            k.typed_wg = wg
        else:
            k.gemv_rows = rows
            k.gemv_wg = k.chunk_wg = wg
        k._pipelines.clear()
        for ops in be.layer_ops:
            ops._cache.clear()
        be._next_decode = None
        be.reset()
        logits = np.stack([be.forward([t]) for t in (1, 5, 9)])
        first = logits if first is None else first
        row = {"kind": kind, "wg": wg, "rows": rows, "max_logit_diff": float(np.abs(logits - first).max()),
               "gpu": {c: gpu_breakdown(be, c, repeats) for c in ctx_list}}
        with tqdm(total=steps * len(ctx_list), desc=f"{kind} {wg}x{rows}", unit="tok") as bar:
            row["decode_ms"] = {c: _median_decode_ms(be, c, steps, bar) for c in ctx_list}
        out["variants"].append(row)
    return out
