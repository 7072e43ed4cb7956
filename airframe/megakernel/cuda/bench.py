"""Benchmark the CUDA megakernel, and PyTorch on the same shapes when it is installed.

What is reported (docs/BENCHMARKS.md, "CUDA megakernel"):
  - ms per token at contexts 1, 512 and 4096, the logits and the greedy token ready: one
    64-step cooperative launch whose steps all run at that context (position context - 1, as the
    PyTorch steps below), timed with CUDA events, divided by 64 (median of several launches);
    beside it the same launch with the position advancing (contexts c .. c + 63: at context 1 the
    attention of up to 64 positions) and a 1-step launch, which adds the launch;
  - tokens/s generating 64 tokens from an 8-token prompt (host wall clock, one launch);
  - the time to the logits of a 2,000-token prompt (host wall clock): its whole prefill blocks
    through the prefill kernel and the rest through decode steps, against every token through
    decode steps;
  - the floor: the bytes one token streams (every matrix once, the K/V cache up to the context)
    over the streaming-read bandwidth measured in the same run, and floor / time;
  - a trace of one token (per-task globaltimer stamps) as JSON, a timeline picture, and the time
    split by wave kind, barrier waits included;
  - PyTorch + transformers on the same config with random BF16 weights, eager attention: eager
    decode steps, and a CUDA-graph replay of a static-cache decode step (logits and argmax).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ..plan.opcodes import Op
from ..plan.pictures import TRACE_FORMAT
from ..plan.planner import plan_is_split, wave_bytes
from .runtime import MAX_STEPS

CONTEXTS = (1, 512, 4096)
STEPS = 64
REPEATS = 5
PROMPT = 2000  # tokens of the prompt whose time to the logits is measured


# ---- the floor ------------------------------------------------------------------------------------
def weight_bytes_per_token(plan) -> int:
    """Bytes of weights one token streams: every matrix once (BF16 or Q8_0; a tied embedding once, as
    the LM head) and the F32 norm vectors; the RoPE tables are read one row per token and left out."""
    return sum(s.n_bytes for name, s in plan.tensors.items() if not name.startswith("rope_"))


def kv_bytes(k: dict, context: int) -> int:
    return k["n_layers"] * k["n_head_kv"] * context * (k["head_dim"] + k["head_dim_v"]) * 4


def floor_ms(plan, context: int, gbs: float) -> float:
    return (weight_bytes_per_token(plan) + kv_bytes(plan.consts, context)) / (gbs * 1e9) * 1e3


# ---- the megakernel -------------------------------------------------------------------------------
def random_kv(runtime, context: int, seed: int = 1) -> None:
    k = runtime.k
    shape = (k["n_layers"], k["n_head_kv"], k["ctx"])
    rng = np.random.default_rng(seed)
    kc = np.zeros((*shape, k["head_dim"]), np.float32)
    vc = np.zeros((*shape, k["head_dim_v"]), np.float32)
    kc[:, :, :context] = rng.standard_normal((*shape[:2], context, k["head_dim"]), dtype=np.float32)
    vc[:, :, :context] = rng.standard_normal((*shape[:2], context, k["head_dim_v"]), dtype=np.float32)
    runtime.set_kv(kc, vc)


def time_context(runtime, context: int, steps: int = STEPS, repeats: int = REPEATS) -> dict:
    """ms per token at `context`: one launch of `steps` forced tokens all at position context - 1
    (the kernel's hold_pos), timed by CUDA events and divided by `steps`, the median of `repeats`
    launches. Beside it the same launch with the position advancing (contexts context ..
    context + steps - 1: at context 1 the mean over contexts 1..64) and a 1-step launch, which adds
    the launch."""
    pos0 = context - 1
    tokens = [(17 + 31 * i) % runtime.k["vocab"] for i in range(steps)]
    runtime.launch(tokens, pos0, hold_pos=True)  # warm-up
    held = [runtime.launch(tokens, pos0, hold_pos=True).ms for _ in range(repeats)]
    ahead = tokens[:min(steps, runtime.k["ctx"] - pos0)]
    moving = [runtime.launch(ahead, pos0).ms for _ in range(repeats)]
    single = [runtime.launch(tokens[:1], pos0).ms for _ in range(4 * repeats)]
    return {"context": context, "steps": steps, "ms_per_token": float(np.median(held)) / steps,
            "ms_per_token_all": [m / steps for m in held],
            "ms_per_token_advancing": float(np.median(moving)) / len(ahead),
            "ms_single_launch": float(np.median(single))}


def generation_rate(runtime, prompt_len: int = 8, new: int = 64, repeats: int = 3) -> dict:
    """Greedy generation through CudaBackend.generate_greedy (two launches for 8 + 64 tokens)."""
    from .backend import CudaBackend

    backend = CudaBackend(runtime, runtime.plan.config)
    prompt = [(5 + 7 * i) % runtime.k["vocab"] for i in range(prompt_len)]
    walls, tokens = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens, _ = backend.generate_greedy(prompt, new)
        walls.append(time.perf_counter() - start)
    wall = float(np.median(walls))
    return {"prompt": prompt_len, "generated": len(tokens), "seconds": wall, "tokens_per_s": len(tokens) / wall,
            "tokens": tokens, "note": "prompt and generated steps together, host wall clock"}


def prompt_time(runtime, n: int = PROMPT, repeats: int = 3) -> dict:
    """Seconds to the logits of an n-token prompt from position 0 through CudaBackend.forward: with
    the prefill kernel (whole blocks; the rest in decode steps) and with decode steps alone (the
    median of `repeats`, host wall clock; every launch waits for the GPU)."""
    from .backend import CudaBackend

    prompt = [(5 + 7 * i) % runtime.k["vocab"] for i in range(min(n, runtime.k["ctx"]))]
    block = runtime.block
    out = {"tokens": len(prompt), "block": block}
    for name, use in (("prefill", block), ("token_by_token", 0)):
        if name == "prefill" and not block:
            continue
        runtime.block = use
        try:
            walls = []
            for _ in range(repeats):
                backend = CudaBackend(runtime, runtime.plan.config)
                start = time.perf_counter()
                backend.forward(prompt)
                walls.append(time.perf_counter() - start)
        finally:
            runtime.block = block
        out[f"{name}_s"] = float(np.median(walls))
        out[f"{name}_tokens_per_s"] = len(prompt) / out[f"{name}_s"]
    return out


def marked_runtime(runtime, trace_mark: int, work: Path | None = None):
    """`runtime`'s package on the worker built with `trace_mark` (AF_TRACE_MARK: where a traced
    task's end stamp is taken): its own plan (the fingerprint names the binary) beside a link to
    the same weights.bin. The caller closes it."""
    import os
    import tempfile
    from dataclasses import replace

    from ..plan.package import Package, write_plan
    from ..plan.planner import make_plan
    from .build import build_worker
    from .runtime import Runtime, Worker

    worker = Worker(runtime.device, build_worker(runtime.device.arch, trace_mark=trace_mark, q8=runtime.worker.build.q8))
    target = replace(runtime.plan.target, binary_sha256=worker.build.sha256, registers_per_thread=worker.registers)
    plan = make_plan(runtime.plan.config, target, runtime.k["ctx"], runtime.k["attn_chunk"],
                     split=plan_is_split(runtime.plan), attn_spread=runtime.k["attn_spread"],
                     attn_wide=runtime.k["attn_wide"], attn_wide_min=runtime.k["attn_wide_min"],
                     weights="q8_0" if runtime.k["weights_q8"] else "bf16")
    folder = Path(tempfile.mkdtemp(dir=work))
    write_plan(plan, folder)
    os.symlink((runtime.package.path / "weights.bin").resolve(), folder / "weights.bin")
    return Runtime(Package.load(folder), worker, progress=False)


# ---- trace ----------------------------------------------------------------------------------------
def trace_token(runtime, context: int) -> dict:
    """The second step of a launch at `context` (both steps at position context - 1), traced: the
    trace JSON of plan/pictures.py plus the time each worker left each wave's barrier
    ("wave_release_ns"), all ns from the first task start."""
    result = runtime.launch([17, 42], context - 1, trace_step=1, hold_pos=True)
    return trace_json(runtime, result.trace, context - 1)


def trace_prefill_step(runtime, context: int) -> dict:
    """The fourth prefill step (block) of a 64-token launch whose last position is context - 1,
    traced as trace_token traces a decode step (its position: the block's first)."""
    pos0 = max(0, context - MAX_STEPS)
    runtime.prefill([(5 + 7 * i) % runtime.k["vocab"] for i in range(MAX_STEPS)], pos0, trace_step=3)
    return trace_json(runtime, runtime.prefill_trace, pos0 + 3 * runtime.block)


def trace_json(runtime, raw: dict, position: int) -> dict:
    plan = runtime.plan
    stamps = raw["tasks"].astype(np.int64)
    t0 = int(stamps[:, 0].min())
    tasks = [[i, int(start - t0), int(end - t0)] for i, (start, end) in enumerate(stamps)]
    return {"format": TRACE_FORMAT, "version": 1, "fingerprint": plan.fingerprint.get("fingerprint"),
            "position": position, "time_unit": "ns", "tasks": tasks,
            "wave_release_ns": (raw["waves"].astype(np.int64) - t0).tolist(), "workers": runtime.workers}


def wave_ideal_ns(plan, position: int, gbs: float) -> np.ndarray:
    """Each wave's weight and K/V bytes at `gbs`, in ns."""
    return wave_bytes(plan, position).sum(axis=1) / gbs


def breakdown(trace: dict, plan, gbs: float) -> dict:
    """Where one token's time goes, per wave kind: wall time, time at full streaming speed, and
    the time between the wave's last task end and its barrier release (waiting and the barrier)."""
    release = np.array(trace["wave_release_ns"], dtype=np.float64)  # (waves, workers)
    ends = release.max(axis=1)
    starts = np.concatenate([[0.0], ends[:-1]])
    last_task = np.zeros(len(ends))
    for index, _, end in trace["tasks"]:
        w = int(plan.tasks[int(index)]["wave"])
        last_task[w] = max(last_task[w], end)
    ideal = wave_ideal_ns(plan, trace["position"], gbs)
    kinds: dict[str, dict] = {}
    for w, info in enumerate(plan.waves):
        d = kinds.setdefault(info["name"].split(".")[-1], {"waves": 0, "wall_us": 0.0, "ideal_us": 0.0,
                                                           "after_last_task_us": 0.0})
        d["waves"] += 1
        d["wall_us"] += (ends[w] - starts[w]) / 1e3
        d["ideal_us"] += ideal[w] / 1e3
        d["after_last_task_us"] += max(0.0, ends[w] - last_task[w]) / 1e3
    return {"token_us": float(ends[-1]) / 1e3, "ideal_us": float(ideal.sum()) / 1e3, "by_kind": kinds,
            "barrier_after_last_task_us": sum(d["after_last_task_us"] for d in kinds.values())}


def task_phases(trace: dict, plan) -> dict:
    """Per opcode, over the tasks of one traced token: the median and largest task time and the
    median start after its wave opened (the latest release of the wave before), in us. With a
    worker built with trace mark 1, a GEMV task's time is its prologue's (norm, merge)."""
    release = np.array(trace["wave_release_ns"], dtype=np.float64)
    opened = np.concatenate([[0.0], release.max(axis=1)[:-1]])
    tasks = np.array(trace["tasks"], dtype=np.float64).reshape(-1, 3)
    index = tasks[:, 0].astype(np.int64)
    ops, waves = plan.tasks["opcode"][index], plan.tasks["wave"][index]
    out = {}
    for op in Op:
        mine = ops == int(op)
        if not mine.any():
            continue
        took = (tasks[mine, 2] - tasks[mine, 1]) / 1e3
        start = (tasks[mine, 1] - opened[waves[mine]]) / 1e3
        out[op.name] = {"tasks": int(mine.sum()), "median_us": float(np.median(took)), "max_us": float(took.max()),
                        "start_median_us": float(np.median(start))}
    return out


def phases(runtime, marks: tuple[int, ...], gbs: float, context: int = 1, work: Path | None = None) -> list:
    """For each trace mark in `marks` (AF_TRACE_MARK; 1 times the prologues): its build's
    ms/token at `context`, and one traced token's task_phases and breakdown."""
    out = []
    for mark in marks:
        other = marked_runtime(runtime, mark, work)
        try:
            random_kv(other, min(context + STEPS - 1, other.k["ctx"]))
            trace = trace_token(other, context)
            row = {"trace_mark": mark, "build": other.worker.build.summary(),
                   "ms_per_token": time_context(other, context, repeats=3)["ms_per_token"],
                   "tasks": task_phases(trace, other.plan), "breakdown": breakdown(trace, other.plan, gbs)}
        finally:
            other.close()
        print(f"phases, trace mark {mark}: {row['ms_per_token']:.4f} ms/token; "
              + "; ".join(f"{op} {t['median_us']:.2f} us (max {t['max_us']:.2f})" for op, t in row["tasks"].items()),
              flush=True)
        out.append(row)
    return out


def write_trace(trace: dict, plan, out: Path, name: str) -> list[Path]:
    """The trace JSON and its timeline picture (plan/pictures.py)."""
    from ..plan.pictures import draw_timeline, read_trace

    path = out / f"{name}.json"
    path.write_text(json.dumps(trace))
    return [path, draw_timeline(plan, read_trace(path, plan), out / f"{name}.png")]


# ---- PyTorch + transformers -----------------------------------------------------------------------
def torch_model(config):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.n_ff,
                      num_hidden_layers=config.n_layers, num_attention_heads=config.n_head,
                      num_key_value_heads=config.n_head_kv, head_dim=config.head_dim,
                      max_position_embeddings=8192, rope_theta=config.rope_base, rms_norm_eps=config.rms_eps,
                      tie_word_embeddings=config.tied_embeddings)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model, cfg


def static_cache(cfg, length: int, device):
    import torch
    from transformers import StaticCache

    try:
        return StaticCache(config=cfg, max_batch_size=1, max_cache_len=length, device=device, dtype=torch.bfloat16)
    except TypeError:
        return StaticCache(config=cfg, max_cache_len=length)


def torch_decode(model, cfg, context: int, steps: int = 16, graph: bool = False) -> float:
    """Median ms of one static-cache decode step at `context` (eager, or a replayed CUDA graph)."""
    import torch

    device = next(model.parameters()).device
    # room for every call below: some transformers versions advance the position per call
    cache = static_cache(cfg, context + 2 * steps + 64, device)
    ids = torch.full((1, 1), 17, dtype=torch.long, device=device)
    pos = torch.full((1,), context - 1, dtype=torch.long, device=device)
    # everything the forward needs already on the device, so nothing is copied during graph capture
    length = context + 2 * steps + 64
    mask = torch.full((1, 1, 1, length), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16, device=device)
    mask[..., :context + 1] = 0

    def step():
        out = model(input_ids=ids, past_key_values=cache, cache_position=pos, position_ids=pos.view(1, 1),
                    attention_mask=mask, use_cache=True)
        return out.logits[:, -1].argmax(-1)

    with torch.inference_mode():
        for _ in range(3):
            step()
        run = step
        if graph and device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            run = g.replay
        times = []
        for i in range(steps):
            pos.fill_(context - 1 + i % 2)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                run()
                times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def torch_baselines(config, contexts=CONTEXTS) -> dict:
    try:
        import torch
        import transformers
    except ImportError as e:
        return {"skipped": f"PyTorch/transformers not installed ({e})"}
    model, cfg = torch_model(config)
    out = {"torch": torch.__version__, "transformers": transformers.__version__, "attention": "eager"}
    for mode in ("eager", "graph"):
        out[mode] = {}
        for c in contexts:
            try:
                out[mode][c] = torch_decode(model, cfg, c, graph=mode == "graph")
            except Exception as e:  # report, do not stop the other measurements
                out[mode][c] = f"{type(e).__name__}: {e}"[:300]
    del model
    return out


# ---- everything -----------------------------------------------------------------------------------
def benchmark(runtime, worker, out: Path | None = None, contexts=CONTEXTS, torch_side: bool = True,
              phase_marks=()) -> dict:
    plan = runtime.plan
    gbs = worker.stream_read_gbs()
    result = {"device": worker.device.name, "stream_read_gbs": gbs, "weights_bytes": weight_bytes_per_token(plan),
              "workers": runtime.workers, "build": worker.build.summary(), "contexts": []}
    random_kv(runtime, min(max(contexts) + STEPS - 1, runtime.k["ctx"]))
    for c in contexts:
        row = time_context(runtime, c)
        row["floor_ms"] = floor_ms(plan, c, gbs)
        row["floor_share"] = row["floor_ms"] / row["ms_per_token"]
        result["contexts"].append(row)
        print(f"context {c}: {row['ms_per_token']:.4f} ms/token, floor {row['floor_ms']:.4f} ms "
              f"({100 * row['floor_share']:.1f}%); advancing from it {row['ms_per_token_advancing']:.4f} ms/token, "
              f"1-step launch {row['ms_single_launch']:.4f} ms", flush=True)
    for c in sorted({min(contexts), max(contexts)}):
        trace = trace_token(runtime, c)
        result[f"trace_ctx{c}"] = breakdown(trace, plan, gbs)
        result[f"trace_ctx{c}"]["tasks"] = task_phases(trace, plan)
        print(f"trace at context {c}: {json.dumps(result[f'trace_ctx{c}'], default=str)[:1500]}", flush=True)
        if out is not None:
            write_trace(trace, plan, out, f"trace_ctx{c}")
    result["generation"] = generation_rate(runtime)
    result["prompt"] = prompt_time(runtime)
    print(f"prompt: {json.dumps(result['prompt'])}", flush=True)
    if phase_marks:
        result["phases"] = phases(runtime, phase_marks, gbs)
    if torch_side:
        result["torch"] = torch_baselines(plan.config, contexts)
    return result


def run(model_path, contexts=CONTEXTS, out: Path | None = None, torch_side: bool = True) -> int:
    """`airframe bench --backend cuda MODEL` lands here: print the results as JSON."""
    from ...model import open_model
    from ...options import RunOptions
    from .backend import CudaBackend

    backend = CudaBackend.load(open_model(model_path), RunOptions(n_ctx=max(contexts) + STEPS, progress=True))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    result = benchmark(backend.runtime, backend.runtime.worker, out, contexts, torch_side)
    print(json.dumps(result, indent=1, default=str))
    return 0

