"""A NaN weight through the CUDA megakernel, on the GPU machine: a synthetic Llama 3.2 1B BF16 file
with one NaN in blk.0.attn_norm must give NonFiniteError (from the kernel's error word) through the
engine, a clear one-line error from `airframe run` and `airframe perplexity`, never a traceback or
NaN text, and a 500 `non_finite_logits` from the server (which runs requests on a thread of its
own), which goes on serving. The same file
without the NaN must generate. Exits 1 if any of that fails.

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

    english = Path(__file__).parents[2] / "tests" / "data" / "english.txt"
    for command in (["run", str(nan), "--backend", "cuda", "--ctx", "64", "-n", "4", "--temp", "0", "Hi"],
                    ["perplexity", str(nan), "--backend", "cuda", "--file", str(english), "--ctx", "64"]):
        done = subprocess.run([sys.executable, "-m", "airframe", *command], capture_output=True, text=True, timeout=600)
        last = done.stderr.strip().splitlines()[-1:] or [""]
        print(f"airframe {command[0]}: exit {done.returncode}, last line of stderr: {last[0]}")
        if done.returncode == 0 or "Traceback" in done.stderr or "NaN" not in done.stderr:
            failures.append(f"`airframe {command[0]}` did not end with a clear NaN error")

    from fastapi.testclient import TestClient

    from airframe.server import create_app

    engine = Engine.load(nan, backend="cuda", options=RunOptions(n_ctx=64))
    with TestClient(create_app(engine)) as client:
        answer = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
        error = answer.json().get("error", {})
        print(f"server: {answer.status_code} {error.get('code')}: {error.get('message')}")
        if answer.status_code != 500 or error.get("code") != "non_finite_logits":
            failures.append("the server did not answer 500 non_finite_logits")
        if client.get("/health").status_code != 200:
            failures.append("the server stopped serving after the error")
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
