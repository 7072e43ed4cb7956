#!/usr/bin/env python3
"""How the attention's spread over chunks (the plan's attn_spread) pays, context by context.

On the GPU machine (with `.mkref` from `megakernel_device_check.py --reference` carried, for its
tokenizer): one worker binary, the synthetic Llama 3.2 1B package planned twice, with the default
spread and with fixed chunks (attn_spread 0); interleaved rounds of the held benchmark at each
context; traced breakdowns at 128 and 512; JSON and a picture in --out.

    python3 scripts/megakernel_spread.py --out DIR [--rounds 3]
    python3 scripts/megakernel_spread.py --draw DIR/spread.json -o PICTURE.png   (anywhere)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

CONTEXTS = (1, 33, 64, 65, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
NAMES = {"spread": "spread (default)", "fixed": "fixed chunks (attn_spread 0)"}


def measure(rounds: int) -> dict:
    import numpy as np

    from airframe.megakernel import cuda_bench
    from airframe.megakernel.build import build_worker
    from airframe.megakernel.cuda_runtime import Device, Runtime, Worker
    from airframe.megakernel.package import write_package
    from airframe.megakernel.probe import probe
    from megakernel_device_check import CTX, SHAPES, make_model

    work = Path("/tmp/mk_spread")
    work.mkdir(exist_ok=True)
    device = Device()
    worker = Worker(device, build_worker(device.arch))
    target = probe(device, worker)
    gguf = make_model(SHAPES["llama1b"], work / "llama1b.gguf", ".mkref/tokenizer.gguf")
    runtimes = {name: Runtime(write_package(gguf, target, work / f"{name}.pkg", ctx=CTX, progress=False,
                                            attn_spread=None if name == "spread" else 0), worker, progress=False)
                for name in NAMES}
    for rt in runtimes.values():
        cuda_bench.random_kv(rt, max(CONTEXTS) + cuda_bench.STEPS)
    times = {name: {c: [] for c in CONTEXTS} for name in runtimes}
    for _ in range(rounds):
        for name, rt in runtimes.items():
            for c in CONTEXTS:
                times[name][c].append(cuda_bench.time_context(rt, c, repeats=3)["ms_per_token"])
    for c in CONTEXTS:
        fixed, spread = np.median(times["fixed"][c]), np.median(times["spread"][c])
        print(f"context {c:5d}: fixed {fixed:.4f}  spread {spread:.4f}  ({1e3 * (spread - fixed):+.1f} us)", flush=True)
    breakdown = {}
    for name, rt in runtimes.items():
        for c in (128, 512):
            bk = cuda_bench.breakdown(cuda_bench.trace_token(rt, c), rt.plan, target.bandwidth_gbs)
            breakdown[f"{name}_{c}"] = bk
            print(name, c, "token", round(bk["token_us"], 1),
                  {k: round(v["wall_us"], 1) for k, v in bk["by_kind"].items()}, flush=True)
    return {"binary": worker.build.sha256, "build": worker.build.summary(), "contexts": list(CONTEXTS),
            "times": {n: {str(c): v for c, v in d.items()} for n, d in times.items()}, "breakdown": breakdown,
            "date": time.strftime("%Y-%m-%d")}


def draw(result: dict, path: Path) -> Path:
    from airframe.megakernel.pictures import draw_context_curves

    times = {NAMES.get(n, n): {int(c): v for c, v in d.items()} for n, d in result["times"].items()}
    binary = result.get("binary", "?")[:8]
    return draw_context_curves(times, path, f"Llama 3.2 1B shape (BF16) on the H200, worker {binary}: "
                                            "attention chunks spread or fixed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="folder for spread.json and spread.png (GPU machine)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draw", type=Path, metavar="JSON", help="redraw the picture of a saved run")
    ap.add_argument("-o", "--output", type=Path, help="the picture, with --draw")
    args = ap.parse_args()
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
