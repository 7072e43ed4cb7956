#!/usr/bin/env python3
"""The floor of the grid-barrier design on this GPU, and what each chain adds to it.

A worker built with AF_STREAM_ONLY=1 keeps only what the design cannot do without: the waves, the
grid barrier after each, and every weight byte read by the same loads as the worker's. It skips
the norms and merges before the GEMVs, the attention, the FFN's fixed-point atomics and the WO
residual (its results are not the model's; the error word is neither set nor read). Switches put
the chains back one at a time (AF_SO_ATOMIC, AF_SO_PROLOGUE, AF_SO_ATTN), and the last step is the
worker itself. All builds run the same plan over the same weights, in interleaved rounds of the
held benchmark (the token at the context), with one traced token each at context 1.

On the GPU machine (`.mkref` from `megakernel_device_check.py --reference` carried, for its
tokenizer):

    python3 scripts/megakernel_floor.py --out DIR [--rounds 3]
    python3 scripts/megakernel_floor.py --draw DIR/floor.json -o PICTURE.png   (anywhere)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

CONTEXTS = (1, 512)
FLOOR = ("AF_STREAM_ONLY=1",)
# (label, defines) from the floor to the worker; each step adds one chain to the one before
STEPS = (
    ("floor: waves, barriers, weights", FLOOR),
    ("+ FFN atomics", FLOOR + ("AF_SO_ATOMIC=1",)),
    ("+ norms and merges", FLOOR + ("AF_SO_ATOMIC=1", "AF_SO_PROLOGUE=1")),
    ("+ attention", FLOOR + ("AF_SO_ATOMIC=1", "AF_SO_PROLOGUE=1", "AF_SO_ATTN=1")),
    ("+ WO residual: the worker", ()),
)
# measured beside them: the attention's cost on the floor alone
EXTRA = (("floor + attention", FLOOR + ("AF_SO_ATTN=1",)),)
BAR_MS = 0.80  # issue 8's first bar at context 1


def measure(rounds: int, contexts=CONTEXTS) -> dict:
    import numpy as np

    from airframe.megakernel import cuda_bench
    from megakernel_device_check import llama1b_runtime

    work = Path("/tmp/mk_floor")
    base, target = llama1b_runtime(work)
    worker = base.worker
    builds = STEPS + EXTRA
    runtimes = {label: base if not defines else cuda_bench.variant_runtime(base, defines, work)
                for label, defines in builds}
    for rt in runtimes.values():
        cuda_bench.random_kv(rt, max(contexts) + cuda_bench.STEPS)
    times = {label: {c: [] for c in contexts} for label in runtimes}
    for _ in range(rounds):
        for label, rt in runtimes.items():
            for c in contexts:
                times[label][c].append(cuda_bench.time_context(rt, c, repeats=3)["ms_per_token"])
    breakdown = {}
    for label, rt in runtimes.items():
        bk = cuda_bench.breakdown(cuda_bench.trace_token(rt, 1), rt.plan, target.bandwidth_gbs)
        breakdown[label] = bk
        print(f"{label:34s}", "  ".join(f"ctx {c}: {np.median(times[label][c]):.4f}" for c in contexts),
              " traced token at ctx 1:", round(bk["token_us"], 1), "us",
              {k: round(v["wall_us"], 1) for k, v in bk["by_kind"].items()}, flush=True)
    return {"binary": worker.build.sha256, "stream_gbs": target.bandwidth_gbs, "contexts": list(contexts),
            "steps": [[label, list(defines)] for label, defines in STEPS],
            "extra": [[label, list(defines)] for label, defines in EXTRA],
            "builds": {label: rt.worker.build.summary() for label, rt in runtimes.items()},
            "times": {label: {str(c): v for c, v in d.items()} for label, d in times.items()},
            "ideal_ms": {str(c): cuda_bench.floor_ms(base.plan, c, target.bandwidth_gbs) for c in contexts},
            "breakdown_ctx1": breakdown, "date": time.strftime("%Y-%m-%d")}


def step_times(result: dict) -> dict[int, list[tuple[str, float]]]:
    """Per context, (label, median ms/token over the rounds) of each step, floor first."""
    import numpy as np

    return {int(c): [(label, float(np.median(result["times"][label][str(c)]))) for label, _ in result["steps"]]
            for c in result["contexts"]}


def draw(result: dict, path: Path) -> Path:
    from airframe.megakernel.pictures import draw_cost_steps

    lines = {int(c): {"weights + K/V at the stream rate": ideal} for c, ideal in result["ideal_ms"].items()}
    lines.setdefault(1, {})["bar 0.80 ms"] = BAR_MS
    return draw_cost_steps(step_times(result), path,
                           f"Llama 3.2 1B shape (BF16) on the H200, worker {result['binary'][:8]}: "
                           "the grid-barrier design's floor and what each chain adds", lines)


def main() -> int:
    from airframe.megakernel.cuda_bench import measurement_main

    return measurement_main(__doc__, "floor", measure, draw)


if __name__ == "__main__":
    sys.exit(main())
