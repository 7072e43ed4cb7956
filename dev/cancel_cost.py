"""What the server's cancel hook (a client that may leave) costs and bounds, on the GPU machine, on
a synthetic Llama 3.2 1B BF16 file: a 2,048-token prompt prefilled on WebGPU with and without the
hook (with it, each chunk is waited for, so that a cancel stops the next one); greedy ms/token on
the CUDA megakernel with and without it (with it, a launch makes CANCEL_TOKENS tokens instead of
up to MAX_STEPS); and, on CUDA, how many tokens are made after a cancel at 10, 25 and 40 tokens
(at most CANCEL_TOKENS). Exits 1 if that bound is broken.

    python dev/cancel_cost.py --tokenizer .device/tokenizer-only-smollm2.gguf
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from airframe.backend import open_backend
from airframe.megakernel.cuda.backend import CANCEL_TOKENS
from airframe.model import open_model
from airframe.options import RunOptions
from airframe.synthetic import TOKENIZER_SOURCE, write_synthetic_gguf

ROUNDS = 5


def median_s(run) -> float:
    run()  # the first use of each program and launch shape
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def webgpu_prefill(path: Path) -> None:
    be = open_backend("webgpu", open_model(path), RunOptions(n_ctx=2048 + 64, progress=False))
    tokens = [(7 * i) % 5000 + 1 for i in range(2048)]

    def prefill(cancel):
        be.reset()
        be.prefill(tokens, cancel)
        be.forward([1])  # the last chunk has run once this returns

    plain, hooked = median_s(lambda: prefill(None)), median_s(lambda: prefill(lambda: False))
    print(f"webgpu prefill of 2,048 tokens: {plain * 1e3:.1f} ms without a cancel hook, {hooked * 1e3:.1f} with "
          f"({(hooked / plain - 1) * 100:+.1f}%)")


def cuda_decode(path: Path) -> bool:
    be = open_backend("cuda", open_model(path), RunOptions(n_ctx=512))
    prompt, n = [1, 500, 77], 256

    def greedy(cancel):
        made = sum(len(ids) for ids, _ in be.greedy_stream(prompt, n, cancel=cancel))
        assert made == n, made

    plain, hooked = median_s(lambda: greedy(None)), median_s(lambda: greedy(lambda: False))
    print(f"cuda greedy, {n} tokens: {plain / n * 1e3:.3f} ms/token without a cancel hook, {hooked / n * 1e3:.3f} "
          f"with ({(hooked / plain - 1) * 100:+.1f}%)")
    ok = True
    for at in (10, 25, 40):
        made = 0
        for ids, _ in be.greedy_stream(prompt, n, cancel=lambda: made >= at):
            made += len(ids)
        after = made - at
        ok &= after <= CANCEL_TOKENS
        print(f"cuda cancel after {at} tokens: {max(after, 0)} made after it (bound {CANCEL_TOKENS})")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=TOKENIZER_SOURCE)
    args = parser.parse_args()
    path = write_synthetic_gguf(Path(tempfile.mkdtemp(prefix="airframe-cancel-")) / "l1b.gguf", "llama",
                                "llama3.2-1b", "BF16", fast=True, tokenizer=args.tokenizer)
    webgpu_prefill(path)
    return 0 if cuda_decode(path) else 1


if __name__ == "__main__":
    raise SystemExit(main())
