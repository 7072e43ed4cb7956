"""Smoke test of whole models: what to run after a shader changes or when a new model arrives.

For each model: load it (WebGPU unless --backend says otherwise), round-trip text through its
tokenizer, generate a greedy continuation and compare it with the expected one, compare decode
after prefill with one-shot prefill, render its chat template, and stream one request through a
real `airframe serve` on a loopback port. Prints a table (model x check: pass/FAIL/skip, seconds)
and exits 0 only when nothing failed.

    python scripts/model_smoke_test.py                       # every verified model
    python scripts/model_smoke_test.py --only gemma3-270m --skip-server
    python scripts/model_smoke_test.py --model ./my-model.gguf
    python scripts/model_smoke_test.py --family qwen3        # a synthetic model of any family
    python scripts/model_smoke_test.py --write-golden        # regenerate tests/data/golden/ (numpy)

A failing check shows its reason in the table's notes; AIRFRAME_SMOKE_TRACEBACK=1 also prints the
traceback of an unexpected exception.

Expected continuations: for the real models, `tests/data/golden/<name>.json`, written once by the
numpy reference backend (--write-golden), never by the backend under test. For any other model
(synthetic, --model) the reference backend generates the expectation on the spot; the comparison
stops at the first position where the reference's top two logits are nearly tied, because there
the float rounding of a different backend may honestly pick the other token.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from airframe.backend import BACKENDS, DEFAULT_BACKEND, open_backend
from airframe.engine import Engine
from airframe.errors import AirframeError
from airframe.family import families
from airframe.model import open_model
from airframe.models import resolve_model
from airframe.options import RunOptions

REPO = Path(__file__).resolve().parent.parent
GOLDEN_DIR = REPO / "tests" / "data" / "golden"

# The real models, then a tiny synthetic model (airframe/synthetic.py) of every family in family/.
REAL_MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
SYNTHETIC_FAMILIES = tuple(sorted({family.name for family in families().values()}))
VERIFIED_MODELS = REAL_MODELS + tuple(f"synthetic-{family}" for family in SYNTHETIC_FAMILIES)

N_CTX = 256
PROMPT = "The capital of France is"
# Models whose greedy continuation of PROMPT has near ties: their golden tokens come from a prompt they answer clearly
PROMPTS = {"qwen2.5-coder-0.5b": "def fibonacci(n):"}
GOLDEN_TOKENS = 8          # greedy tokens compared with the expectation
SERVER_TOKENS = 4          # tokens streamed through the server
DECODE_STEPS = 3           # positions run one by one after a prefill, against one-shot prefill
NEAR_TIE = 1e-2            # reference (top-1 - top-2) / max |logit| below this: stop comparing
PREFILL_DECODE_TOL = 2e-3  # decode vs one-shot prefill, max |diff| / max |logit|, f32 products both ways
PREFILL_DECODE_TOL_F16 = 0.15  # ... where chunks sum products in f16 (gemm.wgsl, attention_prefill.wgsl)
# and decode rounds x to 8 bits (gemv.wgsl's units of the quantized types): Gemma 3 270M 0.127 at the
# step of id 1 (its <eos>; 0.076 with its Q5_0 matrices on float units, 0.011 with every matrix);
# Qwen2.5-Coder 0.5B 0.024, SmolLM2 0.023 (lavapipe, --matmul tiled)
SERVER_START_SECONDS = 300
ROUND_TRIP_TEXTS = (
    "Hello, world! 123",
    "  two leading spaces, a tab\tand\nnew lines\n\n",
    "Accents: café, naïve, Ærøskøbing; symbols: ≤ → €",
    "def f(x):\n    return x ** 2  # code",
    "emoji 🙂 and 漢字",
)
CHAT = [{"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"}]


# ---- what a run records -----------------------------------------------------------------------
@dataclass
class Check:
    name: str
    status: str = "skip"   # "pass" | "FAIL" | "skip"
    seconds: float = 0.0
    detail: str = ""


@dataclass
class ModelRun:
    name: str
    path: Path
    prompt: str = PROMPT
    checks: list[Check] = field(default_factory=list)
    greedy_ids: list[int] | None = None  # what the backend under test generated

    @property
    def ok(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)


CHECKS = ("load", "tokenizer", "golden", "prefill/decode", "chat template", "server")


def timed(run: ModelRun, name: str, body: Callable[[], str], skip: str | None = None) -> Check:
    """Run one check; AssertionError and AirframeError (and anything else) become a FAIL row."""
    check = Check(name)
    run.checks.append(check)
    if skip is not None:
        check.detail = skip
        return check
    started = time.perf_counter()
    try:
        check.detail = body() or ""
        check.status = "pass"
    except AssertionError as e:
        check.status, check.detail = "FAIL", str(e)
    except Exception as e:  # a smoke test reports every failure in its table and goes on
        check.status, check.detail = "FAIL", f"{type(e).__name__}: {e}"
        if os.environ.get("AIRFRAME_SMOKE_TRACEBACK") == "1":
            traceback.print_exc()
    check.seconds = time.perf_counter() - started
    return check


# ---- greedy generation and expectations ---------------------------------------------------------
def greedy(backend, prompt_ids: list[int], n: int, stop_ids: set[int]) -> tuple[list[int], list[float]]:
    """n greedy tokens (fewer at an end-of-generation token) and each step's top-1 minus top-2 logit."""
    backend.reset()
    logits = backend.forward(prompt_ids)
    ids, margins = [], []
    for step in range(n):
        if step:
            logits = backend.forward([ids[-1]])
        top2 = np.partition(logits, -2)[-2:]
        margins.append(float(top2[1] - top2[0]) / _scale(logits))
        ids.append(int(np.argmax(logits)))
        if ids[-1] in stop_ids:
            break
    return ids, margins


def _scale(logits: np.ndarray) -> float:
    """The largest |logit|: float errors of a backend grow with it."""
    return max(float(np.abs(logits).max()), 1e-6)


def load_golden(path: Path) -> dict | None:
    if not path.is_file():
        return None
    golden = json.loads(path.read_text())
    golden["source"] = f"golden {_shown(path)}"
    return golden


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def prompt_of(name: str) -> str:
    return PROMPTS.get(name, PROMPT)


def reference_expectation(path: Path, engine: Engine, prompt: str) -> dict:
    """Greedy ids and margins from the numpy reference backend, made now."""
    reference = open_backend("reference", open_model(path), RunOptions(n_ctx=N_CTX))
    prompt_ids = engine.tokenize_prompt(prompt)
    ids, margins = greedy(reference, prompt_ids, GOLDEN_TOKENS, engine.eog_ids)
    return {"prompt_ids": prompt_ids, "ids": ids, "margins": margins, "source": "reference backend, now"}


def token_text(engine: Engine, ids: list[int]) -> str:
    """The text the engine streams for these ids (raw token bytes; end-of-generation ids hidden)."""
    shown = [i for i in ids if i not in engine.eog_ids]
    return b"".join(engine.tokenizer.token_bytes(i) for i in shown).decode("utf-8", errors="replace")


# ---- the checks ---------------------------------------------------------------------------------
def check_tokenizer(engine: Engine) -> str:
    tok = engine.tokenizer
    for text in ROUND_TRIP_TEXTS:
        ids = tok.encode(text, add_special=False)
        assert ids, f"{text!r} encodes to no tokens"
        assert max(ids) < engine.config.vocab_size, f"{text!r} encodes to id {max(ids)} >= vocab {engine.config.vocab_size}"
        back = tok.decode(ids)
        assert back == text, f"round trip of {text!r} gave {back!r}"
    return f"{len(ROUND_TRIP_TEXTS)} texts round-trip"


def check_golden(engine: Engine, run: ModelRun, expected: dict) -> str:
    """Greedy tokens equal the expected ones; they may part only where the expectation was a near tie."""
    prompt_ids = engine.tokenize_prompt(run.prompt)
    assert prompt_ids == expected["prompt_ids"], (
        f"the prompt tokenizes to {prompt_ids}, the expectation was made from {expected['prompt_ids']}")
    run.greedy_ids, _ = greedy(engine.backend, prompt_ids, GOLDEN_TOKENS, engine.eog_ids)
    got, want = run.greedy_ids, expected["ids"]
    at = next((i for i in range(len(want)) if i >= len(got) or got[i] != want[i]), None)
    if at is None:
        return f"{len(want)} tokens {token_text(engine, want)!r} = {expected['source']}"
    margin = expected["margins"][at]
    found = token_text(engine, got[at:at + 1]) if at < len(got) else "(nothing)"
    parted = (f"token {at}: got {found!r}, expected {token_text(engine, want[at:at + 1])!r} "
              f"(top-1 - top-2 = {margin:.2g} of max |logit|)")
    assert margin < NEAR_TIE, f"{parted}; {expected['source']}; got text {token_text(engine, got)!r}"
    return f"{at} tokens {token_text(engine, want[:at])!r} = {expected['source']}, then a near tie: {parted}"


def check_prefill_decode(engine: Engine) -> str:
    backend = engine.backend
    ids = engine.tokenize_prompt(PROMPT) + [1 + i for i in range(DECODE_STEPS)]  # any valid ids will do
    backend.reset()
    one_shot = backend.forward(ids, all_logits=True)[-DECODE_STEPS:]
    backend.reset()
    backend.forward(ids[:-DECODE_STEPS])
    stepped = np.stack([backend.forward([t]) for t in ids[-DECODE_STEPS:]])
    scale = _scale(one_shot)
    diff = float(np.abs(stepped - one_shot).max()) / scale
    pipes = getattr(backend, "pipes", None)
    tol = PREFILL_DECODE_TOL_F16 if pipes is not None and pipes.half == "f16" else PREFILL_DECODE_TOL
    assert np.isfinite(stepped).all(), "decode produced non-finite logits"
    assert diff <= tol, (f"decode after prefill differs from one-shot prefill by {diff:.2e} "
                         f"(of the logit scale {scale:.3g}), expected <= {tol}")
    assert (stepped.argmax(1) == one_shot.argmax(1)).all(), "decode and one-shot prefill pick different tokens"
    return f"{DECODE_STEPS} positions, max diff {diff:.1e} of scale {scale:.3g}"


def check_chat_template(engine: Engine) -> str:
    without = engine.render_chat(CHAT, add_generation_prompt=False)
    rendered = engine.render_chat(CHAT)
    for message in CHAT:
        assert message["content"] in rendered, f"{message['role']} message missing from {rendered!r}"
    assert rendered.startswith(without) and len(rendered) > len(without), (
        f"the generation prompt should extend the conversation: {without!r} -> {rendered!r}")
    ids = engine.tokenize_prompt(CHAT)
    engine.check_fits(len(ids))
    ends = [i for i in ids if i in engine.eog_ids]
    assert ends, (f"no end-of-turn token among the {len(ids)} prompt tokens: the template's turn end is not "
                  f"one of the ids that stop generation {sorted(engine.eog_ids)}")
    origin = engine.template.origin
    if origin.endswith("tokenizer.chat_template"):
        origin = "the file's tokenizer.chat_template"
    return f"{origin}: {len(ids)} tokens, {len(ends)} end-of-turn"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base: str, proc: subprocess.Popen, log) -> None:
    import httpx

    deadline = time.monotonic() + SERVER_START_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise AssertionError(f"`airframe serve` exited with {proc.returncode}: {log.read()[-1500:]}")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the server was not ready after {SERVER_START_SECONDS} s")


def _stream_completion(base: str, prompt: str) -> tuple[str, dict | None, str | None]:
    """One streamed /v1/completions request: (text, usage, finish_reason)."""
    import httpx

    body = {"prompt": prompt, "max_tokens": SERVER_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, reason, done = [], None, None, False
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=SERVER_START_SECONDS) as response:
        assert response.status_code == 200, f"status {response.status_code}: {response.read()[:300]!r}"
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text.append(choice.get("text", ""))
                reason = choice.get("finish_reason") or reason
    assert done, "the stream ended without data: [DONE]"
    return "".join(text), usage, reason


def check_server(engine: Engine, run: ModelRun, backend: str) -> str:
    assert run.greedy_ids is not None, "no greedy run to compare with (the golden check did not run)"
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "airframe", "serve", str(run.path), "--port", str(port),
               "--ctx", str(N_CTX), "--backend", backend, "--log-level", "warning"]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            _wait_ready(base, proc, log)
            text, usage, reason = _stream_completion(base, run.prompt)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    ids = run.greedy_ids[:SERVER_TOKENS]
    ended = any(i in engine.eog_ids for i in ids)
    want = token_text(engine, ids)
    assert text == want, f"streamed {text!r}, the backend's own greedy run gave {want!r}"
    assert reason == ("stop" if ended else "length"), f"finish_reason {reason!r}"
    assert usage and usage["completion_tokens"] == len(ids), f"usage {usage}"
    return f"port {port}: {text!r}"


# ---- one model ----------------------------------------------------------------------------------
def smoke(name: str, path: Path, backend: str, skip_server: bool, golden_dir: Path, matmul: str = "auto") -> ModelRun:
    run = ModelRun(name, path, prompt=prompt_of(name))
    holder: dict = {}

    def load() -> str:
        holder["engine"] = Engine.load(str(path), backend=backend, options=RunOptions(n_ctx=N_CTX, matmul=matmul))
        c = holder["engine"].config
        return f"{c.family}, {c.n_layers} layers, n_embd {c.n_embd}, vocab {c.vocab_size}"

    timed(run, "load", load)
    engine = holder.get("engine")
    not_loaded = None if engine is not None else "not loaded"
    timed(run, "tokenizer", lambda: check_tokenizer(engine), not_loaded)
    golden = load_golden(golden_dir / f"{name}.json")
    golden_skip = not_loaded
    if engine is not None and golden is None and backend == "reference":
        golden_skip = "no expectation independent of the reference backend"
        run.greedy_ids, _ = greedy(engine.backend, engine.tokenize_prompt(run.prompt), GOLDEN_TOKENS, engine.eog_ids)
    timed(run, "golden", lambda: check_golden(engine, run, golden or reference_expectation(path, engine, run.prompt)),
          golden_skip)
    timed(run, "prefill/decode", lambda: check_prefill_decode(engine), not_loaded)
    timed(run, "chat template", lambda: check_chat_template(engine), not_loaded)
    server_skip = "--skip-server" if skip_server else (None if run.greedy_ids is not None else "no greedy run")
    timed(run, "server", lambda: check_server(engine, run, backend), server_skip)
    return run


def write_golden(name: str, path: Path, golden_dir: Path) -> Path:
    """A model's expected greedy continuation, from the numpy reference backend."""
    engine = Engine.load(str(path), backend="reference", options=RunOptions(n_ctx=N_CTX, progress=True))
    prompt = prompt_of(name)
    prompt_ids = engine.tokenize_prompt(prompt)
    ids, margins = greedy(engine.backend, prompt_ids, GOLDEN_TOKENS, engine.eog_ids)
    golden = {
        "model": name,
        "file": path.name,
        "generated_by": "numpy reference backend (scripts/model_smoke_test.py --write-golden)",
        "n_ctx": N_CTX,
        "prompt": prompt,
        "prompt_ids": prompt_ids,
        "ids": ids,
        "text": token_text(engine, ids),
        "margins": [round(m, 5) for m in margins],  # (top-1 - top-2 logit) / max |logit|, per token
    }
    golden_dir.mkdir(parents=True, exist_ok=True)
    out = golden_dir / f"{name}.json"
    out.write_text(json.dumps(golden, indent=2, ensure_ascii=False) + "\n")
    return out


# ---- selection and the table ----------------------------------------------------------------------
def synthetic_model(family: str, folder: Path) -> Path:
    from airframe.synthetic import write_synthetic_gguf

    return write_synthetic_gguf(folder / f"synthetic-{family}.gguf", family, "tiny", "Q8_0")


def selected(args, folder: Path) -> list[tuple[str, Callable[[], Path]]]:
    """(name, how to get its path) of every model to run, in order."""
    if args.model:
        return [(Path(p).stem, lambda p=p: resolve_model(p)) for p in args.model]
    if args.family:
        return [(f"synthetic-{f}", lambda f=f: synthetic_model(f, folder)) for f in args.family]
    names = VERIFIED_MODELS if not args.only else args.only
    unknown = [n for n in names if n not in VERIFIED_MODELS]
    if unknown:
        raise SystemExit(f"model_smoke_test: unknown --only {', '.join(unknown)}; "
                         f"expected one of {', '.join(VERIFIED_MODELS)}")
    out = []
    for name in names:
        if name in REAL_MODELS:
            out.append((name, lambda n=name: resolve_model(n)))
        else:
            out.append((name, lambda f=name.removeprefix("synthetic-"): synthetic_model(f, folder)))
    return out


def format_table(runs: list[ModelRun]) -> str:
    width = max([len("model")] + [len(r.name) for r in runs])
    header = f"{'model':<{width}}  " + "  ".join(f"{c:<16}" for c in CHECKS)
    lines = [header, "-" * len(header)]
    for run in runs:
        cells = {c.name: f"{c.status} {c.seconds:5.1f}s" if c.status != "skip" else "skip" for c in run.checks}
        lines.append(f"{run.name:<{width}}  " + "  ".join(f"{cells.get(c, '-'):<16}" for c in CHECKS))
    lines.append("")
    for run in runs:
        for c in run.checks:
            if c.detail:
                lines.append(f"{run.name} {c.name}: {c.status}: {c.detail}")
    failed = sum(not r.ok for r in runs)
    lines.append(f"\n{len(runs) - failed} of {len(runs)} models passed every check")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=BACKENDS, default=DEFAULT_BACKEND, help=f"default {DEFAULT_BACKEND}")
    p.add_argument("--only", action="append", metavar="NAME",
                   help=f"run only this verified model (repeatable): {', '.join(VERIFIED_MODELS)}")
    p.add_argument("--model", action="append", metavar="PATH",
                   help="run on this GGUF file instead (repeatable); expectations come from the reference backend")
    p.add_argument("--family", action="append", metavar="NAME",
                   help="run on a tiny synthetic model of this family instead (repeatable)")
    p.add_argument("--skip-server", action="store_true", help="do not start `airframe serve`")
    p.add_argument("--matmul", choices=("auto", "rows", "tiled"), default="auto",
                   help="WebGPU matmul programs: 'tiled' runs the GPU ones (gemv, gemm) on a CPU adapter too")
    p.add_argument("--golden-dir", type=Path, default=GOLDEN_DIR, metavar="DIR",
                   help=f"where <model name>.json expectations live (default {_shown(GOLDEN_DIR)})")
    p.add_argument("--write-golden", action="store_true",
                   help="write the selected models' expectations into --golden-dir with the numpy "
                        "reference backend, then exit (default selection: the real models)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_golden and not (args.only or args.model or args.family):
        args.only = list(REAL_MODELS)
    runs = []
    with tempfile.TemporaryDirectory(prefix="airframe-smoke-") as folder:
        for name, locate in selected(args, Path(folder)):
            if args.write_golden:
                print(f"wrote {write_golden(name, locate(), args.golden_dir)}")
                continue
            print(f"== {name}", file=sys.stderr, flush=True)
            try:
                path = locate()
            except (AirframeError, OSError) as e:
                run = ModelRun(name, Path("?"))
                run.checks.append(Check("load", "FAIL", 0.0, f"{type(e).__name__}: {e}"))
                runs.append(run)
                continue
            runs.append(smoke(name, path, args.backend, args.skip_server, args.golden_dir, args.matmul))
    if args.write_golden:
        return 0
    print(format_table(runs))
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
