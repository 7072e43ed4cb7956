#!/usr/bin/env python3
"""The CUDA megakernel's checks and measurements, in one run on the GPU machine.

Two modes. On a CPU machine, `--reference DIR` writes what the GPU run compares against: a
tokenizer-only GGUF (the synthetic models take SmolLM2's tokenizer) and the numpy VM's logits
for the synthetic models (SmolLM2 135M and Llama 3.2 1B shapes, each in BF16 and in Q8_0) at contexts 1, 40, 100, 384, 385,
1000 and 4096 (40: one attention chunk of many positions; 100: a short context spread over three
chunks; 1000: a longer one over seven), with the K/V cache before the context
filled from a seeded generator. The VM is slow in Python, so it runs where time is cheap; the GPU
run checks that its weights and K/V fill hash the same.

On the GPU machine, `--ref DIR --out DIR` builds and probes the worker (and its Q8_0 build), makes
the synthetic models and their packages, and then, for each: CUDA logits against the VM's (tolerance, top-1 at every
step), tokens drawn in the kernel against the host's sampler (every step, seven chains; and with
hundreds of candidates tied at the top-k cut) and the VM, and their speed against greedy, prompts through the prefill kernel against decode steps (the
same bits in the logits and the K/V cache), three runs bit for bit, a plan for 20 workers run with
20 blocks (same tokens, with and without the prefill kernel), corrupted packages refused before
launch, a planted non-finite weight giving the error, and the speed benchmark with a trace of one
token. Everything lands in DIR/check.json and a log. `--sampled-only` and `--prefill-only` run
those checks alone, with no VM reference.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shutil
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np

from airframe.errors import AirframeError

CONTEXTS = (1, 40, 100, 384, 385, 1000, 4096)
STEPS = 2  # decode steps from each context, each compared
CTX = 4160  # the package's K/V capacity: 4096 plus a 64-token launch
TOKEN0 = 17
# name: (synthetic shape, GGUF type); a Q8_0 model's package keeps Q8_0 matrices (a worker built with AF_Q8)
MODELS = {"smollm2": ("smollm2-135m", "BF16"), "llama1b": ("llama3.2-1b", "BF16"),
          "smollm2_q8": ("smollm2-135m", "Q8_0"), "llama1b_q8": ("llama3.2-1b", "Q8_0")}
BENCHED = ("llama1b", "llama1b_q8")
TOLERANCE = 1e-3  # max |cuda - vm| over max |vm|, per step
# prompts through the prefill kernel: no whole block, one, a span change of the attention (96, 128),
# and a long one over seven chunks
PREFILL_LENGTHS = (8, 9, 100, 203, 1000)


# ---- shared by both modes -------------------------------------------------------------------------
def fill_kv(k: dict, context: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """K/V caches (layer, kv head, ctx, head_dim) with positions < context - 1 drawn N(0, 1)."""
    shape = (k["n_layers"], k["n_head_kv"], k["ctx"])
    kc = np.zeros((*shape, k["head_dim"]), np.float32)
    vc = np.zeros((*shape, k["head_dim_v"]), np.float32)
    past = context - 1
    if past:
        rng = np.random.default_rng(seed + context)
        kc[:, :, :past] = rng.standard_normal((*shape[:2], past, k["head_dim"]), dtype=np.float32)
        vc[:, :, :past] = rng.standard_normal((*shape[:2], past, k["head_dim_v"]), dtype=np.float32)
    return kc, vc


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).view(np.uint8).data)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(64 << 20):
            h.update(block)
    return h.hexdigest()


def make_model(name: str, out: Path, tokenizer: str) -> Path:
    from airframe.synthetic import write_synthetic_gguf

    shape, qtype = MODELS[name]
    if not out.is_file():
        write_synthetic_gguf(out, "llama", shape, qtype, seed=0, fast=True, tokenizer=tokenizer, progress=True)
    return out


def weights_of(plan) -> str:
    return "q8_0" if plan.consts["weights_q8"] else "bf16"


def vm_reference(package, contexts=CONTEXTS, steps: int = STEPS) -> dict:
    from airframe.megakernel.plan.vm import VM

    out = {}
    for c in contexts:
        vm = VM(package.plan, package.weights)
        kc, vc = fill_kv(package.plan.consts, c)
        vm.kcache[:], vm.vcache[:] = kc, vc
        token, logits, tokens = TOKEN0, [], []
        for s in range(steps):
            row, token = vm.step(token, c - 1 + s)
            logits.append(row)
            tokens.append(token)
        out[c] = {"logits": np.stack(logits), "tokens": np.array(tokens), "kv": digest(kc, vc)}
        print(f"  vm context {c}: tokens {tokens}", flush=True)
    return out


# ---- reference mode (CPU) -------------------------------------------------------------------------
def write_tokenizer_gguf(out: Path) -> Path:
    from gguf import GGUFWriter

    from airframe.synthetic import _add_value, _source_tokenizer

    writer = GGUFWriter(out, "llama")
    for key, value in _source_tokenizer("smollm2-135m").items():
        _add_value(writer, key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return out


def make_reference(ref: Path, work: Path, models: list[str], split: bool) -> None:
    from airframe.megakernel.plan.package import write_package
    from airframe.megakernel.plan.target import NAMED_TARGETS

    ref.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer_gguf(ref / "tokenizer.gguf")
    for name in models:
        start = time.time()
        gguf = make_model(name, work / f"{name}.gguf", str(tok))
        package = write_package(gguf, NAMED_TARGETS["h200"], work / f"{name}.pkg", ctx=CTX, split=split)
        data = vm_reference(package)
        arrays = {f"logits_{c}": d["logits"] for c, d in data.items()}
        arrays.update({f"tokens_{c}": d["tokens"] for c, d in data.items()})
        np.savez_compressed(ref / f"ref_{name}.npz", **arrays)
        meta = {"weights_sha256": file_digest(work / f"{name}.pkg" / "weights.bin"), "split": split,
                "kv_sha256": {str(c): d["kv"] for c, d in data.items()}, "token0": TOKEN0, "steps": STEPS}
        (ref / f"ref_{name}.json").write_text(json.dumps(meta, indent=1))
        print(f"{name}: reference in {time.time() - start:.0f} s", flush=True)


# ---- device mode ----------------------------------------------------------------------------------
class Report:
    def __init__(self, out: Path):
        self.out, self.data = out, {}

    def section(self, name: str, fn, *args):
        start = time.time()
        print(f"== {name}", flush=True)
        try:
            result = fn(*args)
            self.data[name] = {"ok": True, "seconds": round(time.time() - start, 1), "result": result}
        except Exception as e:  # every check reports, the run goes on
            traceback.print_exc()
            self.data[name] = {"ok": False, "seconds": round(time.time() - start, 1),
                               "error": f"{type(e).__name__}: {e}"[:2000]}
            result = None
        print(json.dumps(self.data[name], default=str)[:3000], flush=True)
        self.save()
        if "did not finish" in self.data[name].get("error", ""):
            print("a worker is stuck: stopping here", flush=True)
            os._exit(3)  # the GPU is released only when this process ends
        return result

    def save(self):
        (self.out / "check.json").write_text(json.dumps(self.data, indent=1, default=str))


def compare(runtime, ref: dict, context: int) -> dict:
    """CUDA steps from `context` against the VM's logits and tokens."""
    kc, vc = fill_kv(runtime.k, context)
    runtime.set_kv(kc, vc)
    want = ref[f"logits_{context}"]
    result = runtime.launch([TOKEN0], context - 1, n_steps=len(want), all_logits=True)
    got = runtime.all_logits(result.steps_done)
    rows = []
    for s in range(len(want)):
        err = float(np.abs(got[s] - want[s]).max() / np.abs(want[s]).max())
        top = np.sort(want[s])[-2:]
        rows.append({"rel_max_err": err, "top1_cuda": int(np.argmax(got[s])), "top1_vm": int(np.argmax(want[s])),
                     "vm_top2_gap": float(top[1] - top[0]), "bit_equal": bool(np.array_equal(got[s], want[s]))})
    ok = all(r["rel_max_err"] <= TOLERANCE and r["top1_cuda"] == r["top1_vm"] for r in rows)
    return {"context": context, "ok": ok, "tokens_cuda": result.tokens, "tokens_vm": ref[f"tokens_{context}"].tolist(),
            "steps": rows}


def reproducible(runtime, context: int = 385, runs: int = 3) -> dict:
    kc, vc = fill_kv(runtime.k, context)
    outs = []
    for _ in range(runs):
        runtime.set_kv(kc, vc)
        runtime.launch([TOKEN0], context - 1, n_steps=4, all_logits=True)
        outs.append(runtime.all_logits(4).copy())
    same = all(np.array_equal(o.view(np.uint32), outs[0].view(np.uint32)) for o in outs)
    return {"runs": runs, "context": context, "identical_bits": same, "digests": [digest(o) for o in outs]}


def held_position(runtime, context: int = 385) -> dict:
    """A launch whose steps all run at one position (hold_pos, what the benchmarks time): its
    second step overwrites the first one's K/V there and must give the bits of a one-step launch
    of the same token at that position."""
    kc, vc = fill_kv(runtime.k, context)
    runtime.set_kv(kc, vc)
    runtime.launch([TOKEN0, 42], context - 1, all_logits=True, hold_pos=True)
    held = runtime.all_logits(2)[1].copy()
    runtime.set_kv(kc, vc)
    runtime.launch([42], context - 1, all_logits=True)
    single = runtime.all_logits(1)[0].copy()
    if not np.array_equal(held.view(np.uint32), single.view(np.uint32)):
        raise AssertionError(f"a held launch's second step differs from a one-step launch at position {context - 1} "
                             f"(max |diff| {float(np.abs(held - single).max())})")
    return {"context": context, "identical_bits": True, "digest": digest(held)}


# the sampled section's chains: (label, SamplingParams fields), seeds fixed
SAMPLED = (
    ("default+repeat", dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, seed=1)),
    ("top_k 64", dict(temperature=1.0, top_k=64, top_p=1.0, min_p=0.0, seed=2)),
    ("top_p 0.5", dict(temperature=0.7, top_k=20, top_p=0.5, min_p=0.0, seed=3)),
    ("min_p+presence+frequency", dict(temperature=1.3, top_k=50, top_p=1.0, min_p=0.1, presence_penalty=0.5,
                                      frequency_penalty=0.3, seed=4)),
    ("greedy+repeat", dict(temperature=0.0, repeat_penalty=1.3, repeat_last_n=16, seed=5)),
    ("bias+whole-history repeat", dict(temperature=0.9, top_k=30, repeat_penalty=1.2, repeat_last_n=-1,
                                       logit_bias={5: 4.0, 6: -100.0, 7: 2.5}, seed=6)),
    ("tiny temperature", dict(temperature=1e-3, top_k=10, seed=7)),
)
SAMPLED_PROMPT = [TOKEN0, 5, 6, 7, 8, 9, 10, 11]
SAMPLED_TOKENS = 200
VM_SAMPLED_TOKENS, VM_SAMPLED_CHAINS = 24, 3  # tokens of the first chains checked against the VM (slow on a CPU)


def draw_run(runtime, params: dict, n: int, logits: bool):
    """n tokens drawn in the kernel after SAMPLED_PROMPT, launches of up to 64 steps; with `logits`,
    each step's logits too (the host's sampler then checks every token)."""
    from airframe.megakernel.cuda.sampling import draw_settings
    from airframe.sampling import History, Sampler, SamplingParams

    vocab = runtime.k["vocab"]
    sampler = Sampler(SamplingParams(**params), vocab)
    history = History(list(SAMPLED_PROMPT), n_prompt=len(SAMPLED_PROMPT))
    runtime.clear_kv()
    pending, pos, tokens, mismatches = list(SAMPLED_PROMPT), 0, [], []
    while len(tokens) < n:
        steps = min(64, len(pending) - 1 + n - len(tokens))
        result = runtime.launch(pending, pos, n_steps=steps, all_logits=logits,
                                draw=draw_settings(sampler, history, steps - len(pending) + 1, vocab))
        rows = runtime.all_logits(steps) if logits else None
        for i, token in enumerate(result.tokens[len(pending) - 1:]):
            if logits:
                want = sampler.sample(history, rows[len(pending) - 1 + i])
                if want != token:
                    mismatches.append({"token": len(tokens), "kernel": token, "host": want})
            sampler.accept(history, token)
            tokens.append(token)
        pos += steps
        pending = [tokens[-1]]
    return tokens, mismatches


def sampled(runtime) -> dict:
    """Tokens drawn inside the kernel: at every step the token the host's sampler picks from the
    kernel's own logits (SAMPLED_TOKENS per chain), and three runs the same."""
    rows = {}
    for label, params in SAMPLED:
        tokens, mismatches = draw_run(runtime, params, SAMPLED_TOKENS, logits=True)
        again = [draw_run(runtime, params, SAMPLED_TOKENS, logits=False)[0] for _ in range(2)]
        rows[label] = {"tokens": tokens[:24], "distinct": len(set(tokens)), "host_mismatches": mismatches[:5],
                       "n_host_mismatches": len(mismatches), "three_runs_identical": all(a == tokens for a in again)}
    failed = {label: (r["n_host_mismatches"], r["three_runs_identical"], r["host_mismatches"][:1])
              for label, r in rows.items() if r["n_host_mismatches"] or not r["three_runs_identical"]}
    if failed:  # per chain: tokens unlike the host's pick, whether three runs agree, the first unlike
        raise AssertionError(f"drawn tokens differ (of {SAMPLED_TOKENS} a chain): {failed}")
    return rows


def sampled_ties(runtime, seeds: int = 24) -> dict:
    """Drawn tokens where many candidates tie at the top-k cut: logit_bias lifts the 200 largest
    logits of the first step and 100 consecutive ids (rows of one LM_HEAD task, which then splits
    ties of its own) to one value, exactly; the kernel's token against the host sampler's from the
    same logits, for each seed and for top_k 40 and 64."""
    from airframe.megakernel.cuda.sampling import draw_settings
    from airframe.sampling import History, Sampler, SamplingParams

    vocab = runtime.k["vocab"]
    runtime.clear_kv()
    runtime.launch([TOKEN0], 0, n_steps=1, all_logits=True)
    logits = runtime.all_logits(1)[0].copy()
    lifted = sorted(set(np.argsort(-logits, kind="stable")[:200].tolist()) | set(range(1000, 1100)))
    top = float(np.ceil(float(logits.max()))) + 1.0
    # float32 logit + this = top, exactly (logit_bias takes -100..100)
    bias = {i: top - float(logits[i]) for i in lifted if top - float(logits[i]) <= 100.0}
    mismatches = []
    for seed, top_k in itertools.product(range(seeds), (40, 64)):
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=top_k, top_p=1.0, min_p=0.0, logit_bias=bias,
                                         seed=seed), vocab)
        history = History([TOKEN0], n_prompt=1)
        runtime.clear_kv()
        token = runtime.launch([TOKEN0], 0, n_steps=1, all_logits=True,
                               draw=draw_settings(sampler, history, 1, vocab)).tokens[0]
        want = sampler.sample(history, runtime.all_logits(1)[0])
        if token != want:
            mismatches.append({"seed": seed, "top_k": top_k, "kernel": token, "host": want})
    if mismatches:
        raise AssertionError(f"drawn tokens differ where {len(bias)} candidates tie: {mismatches[:5]}")
    return {"tied": len(bias), "draws": 2 * seeds}


def sampled_vm(runtime, package) -> dict:
    """The kernel's drawn tokens against those the host's sampler picks from the VM's logits over
    the same tokens (the first VM_SAMPLED_CHAINS chains, VM_SAMPLED_TOKENS tokens each)."""
    from airframe.megakernel.plan.vm import VM
    from airframe.sampling import History, Sampler, SamplingParams

    rows = {}
    for label, params in SAMPLED[:VM_SAMPLED_CHAINS]:
        tokens = draw_run(runtime, params, VM_SAMPLED_TOKENS, logits=False)[0]
        vm = VM(package.plan, package.weights)
        sampler = Sampler(SamplingParams(**params), runtime.k["vocab"])
        history = History(list(SAMPLED_PROMPT), n_prompt=len(SAMPLED_PROMPT))
        for pos, token in enumerate(SAMPLED_PROMPT[:-1]):
            vm.step(token, pos)
        fed, picks = SAMPLED_PROMPT[-1], []
        for i, token in enumerate(tokens):
            logits, _ = vm.step(fed, len(SAMPLED_PROMPT) - 1 + i)
            picks.append(sampler.sample(history, logits))
            sampler.accept(history, token)
            fed = token
        rows[label] = {"kernel": tokens, "vm": picks}
    if any(r["kernel"] != r["vm"] for r in rows.values()):
        raise AssertionError(f"drawn tokens differ from the VM's: {rows}")
    return rows


def sampled_speed(runtime, reps: int = 5) -> dict:
    """ms/token of a 64-step launch after a 1-token prompt from position 0, greedy against drawn
    (the default chain with a repetition penalty): the median of `reps` launches each."""
    import statistics

    from airframe.megakernel.cuda.sampling import draw_settings
    from airframe.sampling import History, Sampler, SamplingParams

    def ms(drawn: bool) -> float:
        runtime.clear_kv()
        draw = None
        if drawn:
            sampler = Sampler(SamplingParams(**SAMPLED[0][1]), runtime.k["vocab"])
            draw = draw_settings(sampler, History([TOKEN0], n_prompt=1), 64, runtime.k["vocab"])
        return runtime.launch([TOKEN0], 0, n_steps=64, draw=draw).ms / 64

    out = {"greedy_ms": statistics.median(ms(False) for _ in range(reps)),
           "sampled_ms": statistics.median(ms(True) for _ in range(reps))}
    out["sampled_over_greedy"] = out["sampled_ms"] / out["greedy_ms"]
    return out


def greedy_tokens(runtime, prompt: list[int], n: int) -> list[int]:
    runtime.clear_kv()
    result = runtime.launch(prompt, 0, n_steps=min(64, len(prompt) + n - 1))
    return result.tokens[len(prompt) - 1:]


def cache_rows(runtime, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions 0..n-1 of the K and V caches, every layer and K/V head."""
    k, out = runtime.k, []
    for name, width in (("kcache", "head_dim"), ("vcache", "head_dim_v")):
        full = runtime.device.download(runtime.buffers[name], np.float32, runtime.kv_elements(width))
        out.append(full.reshape(k["n_layers"], k["n_head_kv"], k["ctx"], k[width])[:, :, :n].copy())
    return out[0], out[1]


def prompt_run(runtime, prompt: list[int], block: int, new: int = 16) -> tuple:
    """The prompt's logits and K/V rows through CudaBackend.forward with prefill blocks of `block`
    tokens (0: decode steps only), and the greedy tokens after it."""
    from airframe.megakernel.cuda.backend import CudaBackend

    kept = runtime.block
    runtime.block = block
    try:
        runtime.clear_kv()
        backend = CudaBackend(runtime, runtime.plan.config)
        logits = backend.forward(prompt).copy()
        kc, vc = cache_rows(runtime, len(prompt))
        tokens, _ = backend.generate_greedy(prompt, new)
    finally:
        runtime.block = kept
    return logits, kc, vc, tokens


def prefill_matches_decode(runtime, lengths=PREFILL_LENGTHS) -> dict:
    """A prompt through the prefill kernel against every token through decode steps: the same bits
    in its logits and in the K/V cache, and the same greedy tokens after it."""
    if not runtime.block:
        raise AssertionError("no room for the prefill kernel on this GPU (Runtime.block is 0)")
    rows = []
    for n in lengths:
        prompt = [(TOKEN0 + 31 * i) % runtime.k["vocab"] for i in range(n)]
        pre, dec = prompt_run(runtime, prompt, runtime.block), prompt_run(runtime, prompt, 0)
        bits = [np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(pre[:3], dec[:3])]
        rows.append({"tokens": n, "prefilled": (n - 1) // runtime.block * runtime.block,
                     "identical_bits": {"logits": bits[0], "k": bits[1], "v": bits[2]},
                     "max_logit_diff": float(np.abs(pre[0] - dec[0]).max()), "same_tokens": pre[3] == dec[3],
                     "tokens_prefill": pre[3], "tokens_decode": dec[3]})
    if not all(all(r["identical_bits"].values()) and r["same_tokens"] for r in rows):
        raise AssertionError("prefill differs from decode steps: " + json.dumps(rows)[:1500])
    return {"lengths": rows}


def twenty_workers(worker, runtime, package, folder: Path) -> dict:
    from airframe.megakernel.cuda.probe import with_workers
    from airframe.megakernel.cuda.runtime import Runtime
    from airframe.megakernel.plan.package import Package, write_plan
    from airframe.megakernel.plan.planner import make_plan, plan_is_split

    plan = make_plan(package.plan.config, with_workers(package.plan.target, 20), CTX,
                     split=plan_is_split(package.plan), weights=weights_of(package.plan))
    plan.model["source"] = package.plan.model.get("source")
    if folder.exists():
        shutil.rmtree(folder)
    write_plan(plan, folder)
    os.symlink((package.path / "weights.bin").resolve(), folder / "weights.bin")
    small = Runtime(Package.load(folder), worker, progress=False)
    try:
        prompt = [TOKEN0, 5, 300, 42, 7, 1000]
        t20 = greedy_tokens(small, prompt, 32)
        t_all = greedy_tokens(runtime, prompt, 32)
        out = {"workers": small.workers, "grid": small.workers, "tokens_20": t20, "tokens_full": t_all,
               "same_tokens": t20 == t_all}
        if small.block and runtime.block:  # a 100-token prompt through the prefill kernel on both plans
            long = [(TOKEN0 + 31 * i) % runtime.k["vocab"] for i in range(100)]
            p20, p_all = prompt_run(small, long, small.block)[3], prompt_run(runtime, long, runtime.block)[3]
            out.update(prefill_tokens_20=p20, prefill_tokens_full=p_all, same_prefill_tokens=p20 == p_all)
        return out
    finally:
        small.close()


def corrupted(worker, package, work: Path) -> dict:
    """Each corruption must raise before any launch."""
    from airframe.megakernel.cuda.runtime import Runtime
    from airframe.megakernel.plan.opcodes import TASK_BYTES, TASK_DTYPE
    from airframe.megakernel.plan.package import Package, write_plan
    from airframe.megakernel.plan.planner import make_plan

    out = {}

    def folder(name):
        f = work / f"bad_{name}"
        if f.exists():
            shutil.rmtree(f)
        write_plan(package.plan, f)
        return f

    f = folder("task")
    raw = bytearray((f / "tasks.bin").read_bytes())
    at = TASK_BYTES * 100 + TASK_DTYPE.fields["row_start"][1]
    raw[at:at + 4] = (10 ** 9).to_bytes(4, "little")  # task 100: row_start far out of range
    (f / "tasks.bin").write_bytes(bytes(raw))
    os.symlink((package.path / "weights.bin").resolve(), f / "weights.bin")
    out["task_row_out_of_range"] = _refused(lambda: Package.load(f))
    f = folder("weights")
    with open(f / "weights.bin", "wb") as w:
        w.truncate(package.plan.consts["weights_size"] - 4096)
    out["weights_truncated"] = _refused(lambda: Package.load(f))
    f = work / "bad_binary"
    if f.exists():
        shutil.rmtree(f)
    other = replace(package.plan.target, binary_sha256="0" * 64)
    write_plan(make_plan(package.plan.config, other, CTX, weights=weights_of(package.plan)), f)  # refused either way
    os.symlink((package.path / "weights.bin").resolve(), f / "weights.bin")
    out["other_worker_binary"] = _refused(lambda: Runtime(Package.load(f), worker, progress=False))
    out["ok"] = all(v["refused"] for v in out.values())
    return out


def _refused(fn) -> dict:
    try:
        fn()
    except AirframeError as e:
        return {"refused": True, "error": f"{type(e).__name__}: {e}"[:400]}
    return {"refused": False}


def non_finite(runtime, package) -> dict:
    from airframe.errors import NonFiniteError

    from airframe.megakernel.plan.planner import q8_row_bytes

    plan = package.plan
    name = "output.weight" if "output.weight" in plan.tensors else "token_embd.weight"
    e = plan.consts["n_embd"]
    if plan.consts["weights_q8"]:  # row 7's first f16 block scale: F16 +inf
        offset, bits = plan.tensors[name].offset + 7 * q8_row_bytes(e) + e, b"\x00\x7c"
    else:  # row 7, element 3: BF16 +inf
        offset, bits = plan.tensors[name].offset + 7 * e * 2 + 6, b"\x80\x7f"
    original = bytes(package.weights[offset:offset + 2])
    runtime.poke_weights(offset, bits)
    try:
        runtime.launch([TOKEN0], 0, n_steps=3)
        outcome = {"raised": False}
    except NonFiniteError as e:
        outcome = {"raised": True, "error": str(e)}
    finally:
        runtime.poke_weights(offset, original)
    after = runtime.launch([TOKEN0], 0, n_steps=3)
    outcome["clean_after_restore"] = after.steps_done == 3
    return outcome


# Trace marks (AF_TRACE_MARK, worker_base.cuh) whose builds split a traced token into task phases
# in the bench section (cuda_bench.phases): with mark 1 a GEMV task's time is its prologue's (the
# norm of x, the attention merge).
PHASES = (1,)


def parse_phases(text: str) -> tuple[int, ...]:
    """'1,7' -> (1, 7), each checked here, before any GPU time is spent."""
    from airframe.errors import ParameterError
    from airframe.megakernel.cuda.build import check_trace_mark

    marks = []
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        if not word.isdigit():
            raise ParameterError(f"trace mark {word!r}, expected a number 1..9")
        marks.append(check_trace_mark(int(word)))
    return tuple(marks)


def run_device(ref: Path, out: Path, work: Path, models: list[str], bench: bool, torch_side: bool = True,
               split: bool = False, phase_marks=PHASES, only_sampled: bool = False,
               prefill_only: bool = False) -> Report:
    from airframe.megakernel.cuda import bench as cuda_bench
    from airframe.megakernel.cuda.build import build_worker
    from airframe.megakernel.cuda.probe import probe
    from airframe.megakernel.cuda.runtime import Device, Runtime, Worker
    from airframe.megakernel.plan.package import write_package
    from airframe.megakernel.plan.target import target_from_dict, target_to_dict

    report = Report(out)
    work.mkdir(parents=True, exist_ok=True)
    if not (only_sampled or prefill_only):
        report.section("builds", lambda: {f"{a}{' q8' if q8 else ''}": build_worker(a, q8=q8).summary()
                                          for a in ("sm_86", "sm_90") for q8 in (False, True)})
    device = Device()
    workers = {False: Worker(device)}
    report.section("worker", lambda: workers[False].build.summary())
    target = report.section("probe", lambda: target_to_dict(probe(device, workers[False])))
    (out / "target.json").write_text(json.dumps(target, indent=1))
    probed = target_from_dict(target)
    tok = str(ref / "tokenizer.gguf")
    for name in models:
        q8 = MODELS[name][1] == "Q8_0"
        if q8 not in workers:
            workers[q8] = Worker(device, build_worker(device.arch, q8=q8))
        worker = workers[q8]
        # the probed target, bound to the binary of this model's worker
        target = replace(probed, binary_sha256=worker.build.sha256, registers_per_thread=worker.registers)
        gguf = report.section(f"{name}.model", lambda: str(make_model(name, work / f"{name}.gguf", tok)))
        package = report.section(f"{name}.package",
                                 lambda: write_package(gguf, target, work / f"{name}.pkg", ctx=CTX, split=split))
        if package is None:
            continue
        if prefill_only:
            runtime = report.section(f"{name}.upload", lambda: Runtime(package, worker))
            if runtime is None:
                continue
            report.section(f"{name}.prefill", prefill_matches_decode, runtime)
            report.section(f"{name}.twenty_workers", twenty_workers, worker, runtime, package, work / f"{name}.w20")
            if name in BENCHED:
                report.section(f"{name}.prompt", cuda_bench.prompt_time, runtime)
                gbs = workers[q8].stream_read_gbs()
                for c in (64, 1024):
                    report.section(f"{name}.prefill_step_ctx{c}", lambda: cuda_bench.breakdown(
                        cuda_bench.trace_prefill_step(runtime, c), package.plan, gbs))
                report.section(f"{name}.decode", lambda: [cuda_bench.time_context(runtime, c) for c in (1, 4096)])
            runtime.close()
            continue
        if not only_sampled:
            meta = json.loads((ref / f"ref_{name}.json").read_text())
            refs = dict(np.load(ref / f"ref_{name}.npz"))
            report.section(f"{name}.same_inputs_as_reference", lambda: {
                "split_plans": split, "reference_split_plans": meta.get("split", False),
                "weights": file_digest(package.path / "weights.bin") == meta["weights_sha256"],
                "kv": all(digest(*fill_kv(package.plan.consts, int(c))) == h for c, h in meta["kv_sha256"].items())})
        runtime = report.section(f"{name}.upload", lambda: Runtime(package, worker))
        if runtime is None:
            continue
        report.section(f"{name}.sampled", sampled, runtime)
        report.section(f"{name}.sampled_ties", sampled_ties, runtime)
        report.section(f"{name}.sampled_speed", sampled_speed, runtime)
        if name.startswith("smollm2"):
            report.section(f"{name}.sampled_vm", sampled_vm, runtime, package)
        if only_sampled:
            runtime.close()
            continue
        for c in CONTEXTS:
            report.section(f"{name}.vs_vm.ctx{c}", compare, runtime, refs, c)
        report.section(f"{name}.prefill", prefill_matches_decode, runtime)
        report.section(f"{name}.reproducible", reproducible, runtime)
        report.section(f"{name}.held_position", held_position, runtime)
        report.section(f"{name}.twenty_workers", twenty_workers, worker, runtime, package, work / f"{name}.w20")
        report.section(f"{name}.corrupted", corrupted, worker, package, work)
        report.section(f"{name}.non_finite", non_finite, runtime, package)
        if bench and name in BENCHED:
            report.section("bench" if name == "llama1b" else f"{name}.bench", cuda_bench.benchmark, runtime, worker, out, cuda_bench.CONTEXTS, torch_side,
                           phase_marks)
        runtime.close()
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, help="CPU mode: write the VM reference into this folder")
    parser.add_argument("--ref", type=Path, default=Path(".mkref"), help="GPU mode: the reference folder")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "mk_out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/mk_work"))
    parser.add_argument("--models", default=",".join(MODELS), help=f"a comma list of {', '.join(MODELS)}")
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--no-torch", action="store_true", help="bench without the PyTorch baselines")
    parser.add_argument("--phases", help="trace marks (AF_TRACE_MARK) whose builds split a traced token into "
                        "task phases, e.g. '1,7,8' (default: 1, the prologues); '' for none")
    parser.add_argument("--sampled-only", action="store_true",
                        help="only the drawn tokens' checks and speed (no VM reference folder needed)")
    parser.add_argument("--prefill-only", action="store_true",
                        help="only the prefill kernel's checks (no VM reference needed: the tokenizer GGUF) "
                             "and its prompt and decode times")
    parser.add_argument("--split", action=argparse.BooleanOptionalAction, default=None,
                        help="plans cut into split-K pieces and shared FFN rows (default: the planner's)")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    from airframe.megakernel.plan.planner import SPLIT_DEFAULT

    split = SPLIT_DEFAULT if args.split is None else args.split
    if args.reference:
        make_reference(args.reference, args.work, models, split)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    phase_marks = PHASES if args.phases is None else parse_phases(args.phases)
    report = run_device(args.ref, args.out, args.work, models, not args.no_bench, not args.no_torch, split,
                        phase_marks, args.sampled_only, args.prefill_only)
    failed = [k for k, v in report.data.items() if not v["ok"]]
    print("FAILED sections:" if failed else "all sections ran", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
