"""A NaN weight through the CUDA megakernel, on the GPU machine: a synthetic Llama 3.2 1B BF16 file
with one NaN in blk.0.attn_norm must give NonFiniteError (from the kernel's error word) through the
engine, and a clear one-line error from `airframe run`, never a traceback or NaN text. The same
file without the NaN must generate. Exits 1 if any of that fails.

    python dev/megakernel/non_finite_check.py --tokenizer .device/tokenizer-only-smollm2.gguf
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from airframe.engine import Engine, GenerationParams
from airframe.errors import NonFiniteError
from airframe.options import RunOptions
from airframe.sampling import SamplingParams
from airframe.synthetic import TOKENIZER_SOURCE, plant_nan, write_synthetic_gguf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=TOKENIZER_SOURCE)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="airframe-nan-"))
    clean = write_synthetic_gguf(folder / "l1b.gguf", "llama", "llama3.2-1b", "BF16", fast=True,
                                 tokenizer=args.tokenizer)
    nan = folder / "l1b_nan.gguf"
    nan.write_bytes(clean.read_bytes())
    plant_nan(nan)
    failures = []
    greedy = GenerationParams(max_tokens=4, sampling=SamplingParams(temperature=0.0))  # the kernel's own loop

    text = Engine.load(clean, backend="cuda", options=RunOptions(n_ctx=64)).generate("Hi", greedy)[0]
    print(f"clean file: generated {text!r}")

    try:
        Engine.load(nan, backend="cuda", options=RunOptions(n_ctx=64)).generate("Hi", greedy)
        failures.append("the NaN file generated without an error")
    except NonFiniteError as e:
        print(f"engine: NonFiniteError: {e}")

    run = subprocess.run([sys.executable, "-m", "airframe", "run", str(nan), "--backend", "cuda", "--ctx", "64",
                          "-n", "4", "--temp", "0", "Hi"], capture_output=True, text=True, timeout=600)
    print(f"airframe run: exit {run.returncode}, stderr:\n{run.stderr.strip()}")
    if run.returncode == 0 or "Traceback" in run.stderr or "NaN" not in run.stderr:
        failures.append("`airframe run` did not end with a clear NaN error")
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
