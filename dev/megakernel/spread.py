#!/usr/bin/env python3
"""How spreading the attention over chunks (the plan's attn_spread and attn_wide) pays, context by
context.

On the GPU machine (with `.mkref` from `scripts/megakernel_device_check.py --reference` carried,
for its tokenizer): the synthetic Llama 3.2 1B package on one runtime, its plan constants switched
between launches to each rule in RULES (the tasks do not depend on them: the script checks that
the planner cuts the same tasks for every rule), so that every rule runs on the same buffers and
the same upload. Interleaved rounds of the held benchmark at each context, traced breakdowns at
512 and 1536; JSON and a picture in --out.

    python3 dev/megakernel/spread.py --out DIR [--rounds 3]
    python3 dev/megakernel/spread.py --draw DIR/spread.json -o PICTURE.png   (anywhere)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CONTEXTS = (1, 33, 64, 96, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 3072, 4096)
# name: make_plan's arguments for the rule (none given: the planner's defaults)
RULES = {"spread": {}, "narrow": {"attn_wide": 0}, "fixed": {"attn_spread": 0}}
NAMES = {"spread": "spread (default: 4 chunks of 32+, 16 of 128+)",
         "narrow": "up to 4 chunks (attn_wide 0)",
         "fixed": "fixed chunks (attn_spread 0)"}
RULE_KEYS = ("attn_spread", "attn_min", "attn_wide", "attn_wide_min")


def llama1b_runtime(work: Path):
    """This GPU's worker, its probed target, and a runtime of the synthetic Llama 3.2 1B package
    (the device check's CTX positions) built in `work`. Returns (runtime, target)."""
    from megakernel_device_check import CTX, SHAPES, make_model

    from airframe.megakernel.cuda.build import build_worker
    from airframe.megakernel.cuda.probe import probe
    from airframe.megakernel.cuda.runtime import Device, Runtime, Worker
    from airframe.megakernel.plan.package import write_package

    work.mkdir(exist_ok=True)
    device = Device()
    worker = Worker(device, build_worker(device.arch))
    target = probe(device, worker)
    gguf = make_model(SHAPES["llama1b"], work / "llama1b.gguf", ".mkref/tokenizer.gguf")
    package = write_package(gguf, target, work / "llama1b.pkg", ctx=CTX, progress=False)
    return Runtime(package, worker, progress=False), target


def measure(rounds: int) -> dict:
    import numpy as np
    from megakernel_device_check import CTX

    from airframe.family import load_config
    from airframe.gguf_file import GGUFFile
    from airframe.megakernel.cuda import bench
    from airframe.megakernel.plan.planner import make_plan

    work = Path("/tmp/mk_spread")
    runtime, target = llama1b_runtime(work)
    worker = runtime.worker
    config = load_config(GGUFFile(work / "llama1b.gguf"))  # (llama1b_runtime's model)
    rules = {}
    for name, kwargs in RULES.items():
        plan = make_plan(config, target, CTX, **kwargs)
        if not np.array_equal(plan.tasks, runtime.plan.tasks):
            raise RuntimeError(f"rule {name}: the planner cut other tasks; its constants cannot be switched")
        rules[name] = {key: plan.consts[key] for key in RULE_KEYS}

    def use(name):
        runtime.k.update(rules[name])

    bench.random_kv(runtime, max(CONTEXTS) + bench.STEPS)
    times = {name: {c: [] for c in CONTEXTS} for name in rules}
    for _ in range(rounds):
        for name in rules:
            use(name)
            for c in CONTEXTS:
                times[name][c].append(bench.time_context(runtime, c, repeats=3)["ms_per_token"])
    for c in CONTEXTS:
        print(f"context {c:5d}: " + "  ".join(f"{name} {np.median(times[name][c]):.4f}" for name in rules), flush=True)
    breakdown = {}
    for name in rules:
        use(name)
        for c in (512, 1536):
            bk = bench.breakdown(bench.trace_token(runtime, c), runtime.plan, target.bandwidth_gbs)
            breakdown[f"{name}_{c}"] = bk
            print(name, c, "token", round(bk["token_us"], 1),
                  {k: round(v["wall_us"], 1) for k, v in bk["by_kind"].items()}, flush=True)
    use("spread")
    return {"binary": worker.build.sha256, "build": worker.build.summary(), "contexts": list(CONTEXTS),
            "rules": rules, "times": {n: {str(c): v for c, v in d.items()} for n, d in times.items()},
            "breakdown": breakdown, "date": time.strftime("%Y-%m-%d")}


def draw_context_curves(times: dict[str, dict[int, list[float]]], path: Path, title: str) -> Path:
    """ms/token against the context, one line per rule (median of its rounds, the spread of the
    rounds as a band): `times[name][context]` holds each round's ms/token."""
    if not times or not all(times.values()):
        raise ValueError("no timings to draw: expected {name: {context: [ms per token, ...]}}")
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, by_context in times.items():
        contexts = sorted(by_context)
        rounds = [np.asarray(by_context[c], dtype=float) for c in contexts]
        ax.plot(contexts, [np.median(r) for r in rounds], marker="o", markersize=3, label=name)
        ax.fill_between(contexts, [r.min() for r in rounds], [r.max() for r in rounds], alpha=0.25)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (positions; the token at position context - 1)")
    ax.set_ylabel("ms / token")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw(result: dict, path: Path) -> Path:
    times = {NAMES.get(n, n): {int(c): v for c, v in d.items()} for n, d in result["times"].items()}
    binary = result.get("binary", "?")[:8]
    return draw_context_curves(times, path, f"Llama 3.2 1B shape (BF16) on the H200, worker {binary}: "
                                            "how far the attention is spread over chunks")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="folder for spread.json and spread.png (GPU machine)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draw", type=Path, metavar="JSON", help="redraw the picture of a saved run")
    ap.add_argument("-o", "--output", type=Path, help="the picture, with --draw")
    args = ap.parse_args(argv)
    if args.draw:
        print(draw(json.loads(args.draw.read_text()), args.output or args.draw.with_suffix(".png")))
        return 0
    if not args.out:
        ap.error("--out DIR (or --draw JSON)")
    args.out.mkdir(parents=True, exist_ok=True)
    result = measure(args.rounds)
    (args.out / "spread.json").write_text(json.dumps(result, indent=1, default=float))
    print(draw(result, args.out / "spread.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
