#!/usr/bin/env python3
"""How spreading the attention over chunks (the plan's attn_spread and attn_wide) pays, context by
context.

On the GPU machine (with `.mkref` from `megakernel_device_check.py --reference` carried, for its
tokenizer): the synthetic Llama 3.2 1B package on one runtime, its plan constants switched
between launches to each rule in RULES (the tasks do not depend on them: the script checks that
the planner cuts the same tasks for every rule), so that every rule runs on the same buffers and
the same upload. Interleaved rounds of the held benchmark at each context, traced breakdowns at
512 and 1536; JSON and a picture in --out.

    python3 scripts/megakernel_spread.py --out DIR [--rounds 3]
    python3 scripts/megakernel_spread.py --draw DIR/spread.json -o PICTURE.png   (anywhere)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

CONTEXTS = (1, 33, 64, 96, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 3072, 4096)
# name: make_plan's arguments for the rule (none given: the planner's defaults)
RULES = {"spread": {}, "narrow": {"attn_wide": 0}, "fixed": {"attn_spread": 0}}
NAMES = {"spread": "spread (default: 4 chunks of 32+, 16 of 128+)",
         "narrow": "up to 4 chunks (attn_wide 0, the twelfth session's)",
         "fixed": "fixed chunks (attn_spread 0)"}
# the twelfth session's saved run (before attn_wide): two packages, "spread" meaning up to 4 chunks
NAMES_SESSION12 = {"spread": "spread (up to 4 chunks)", "fixed": "fixed chunks (attn_spread 0)"}
RULE_KEYS = ("attn_spread", "attn_min", "attn_wide", "attn_wide_min")


def measure(rounds: int) -> dict:
    import numpy as np

    from airframe.family import load_config
    from airframe.gguf_file import GGUFFile
    from airframe.megakernel.cuda import bench as cuda_bench
    from airframe.megakernel.plan.planner import make_plan
    from megakernel_device_check import CTX, llama1b_runtime

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

    cuda_bench.random_kv(runtime, max(CONTEXTS) + cuda_bench.STEPS)
    times = {name: {c: [] for c in CONTEXTS} for name in rules}
    for _ in range(rounds):
        for name in rules:
            use(name)
            for c in CONTEXTS:
                times[name][c].append(cuda_bench.time_context(runtime, c, repeats=3)["ms_per_token"])
    for c in CONTEXTS:
        print(f"context {c:5d}: " + "  ".join(f"{name} {np.median(times[name][c]):.4f}" for name in rules), flush=True)
    breakdown = {}
    for name in rules:
        use(name)
        for c in (512, 1536):
            bk = cuda_bench.breakdown(cuda_bench.trace_token(runtime, c), runtime.plan, target.bandwidth_gbs)
            breakdown[f"{name}_{c}"] = bk
            print(name, c, "token", round(bk["token_us"], 1),
                  {k: round(v["wall_us"], 1) for k, v in bk["by_kind"].items()}, flush=True)
    use("spread")
    return {"binary": worker.build.sha256, "build": worker.build.summary(), "contexts": list(CONTEXTS),
            "rules": rules, "times": {n: {str(c): v for c, v in d.items()} for n, d in times.items()},
            "breakdown": breakdown, "date": time.strftime("%Y-%m-%d")}


def draw(result: dict, path: Path) -> Path:
    from airframe.megakernel.plan.pictures import draw_context_curves

    names = NAMES if "rules" in result else NAMES_SESSION12
    times = {names.get(n, n): {int(c): v for c, v in d.items()} for n, d in result["times"].items()}
    binary = result.get("binary", "?")[:8]
    return draw_context_curves(times, path, f"Llama 3.2 1B shape (BF16) on the H200, worker {binary}: "
                                            "how far the attention is spread over chunks")


def main() -> int:
    from airframe.megakernel.cuda.bench import measurement_main

    return measurement_main(__doc__, "spread", measure, draw)


if __name__ == "__main__":
    sys.exit(main())
