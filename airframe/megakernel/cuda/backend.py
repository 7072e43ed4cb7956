"""CudaBackend: the megakernel as an airframe backend (`--backend cuda`).

`forward` runs tokens through the persistent worker, one cooperative launch per 64 tokens, and
reads back the logits: a prompt's tokens but its last go through the prefill kernel in blocks of
`Runtime.block` where the GPU has room for it (the same K/V bits as decode steps), the rest
through decode steps. Because the logits come back to the host, the engine's sampler works
unchanged, at the price of one launch and one logits copy per token. `greedy_stream` is the fast path: up to 64
tokens per launch with the argmax and the end-of-generation test inside the kernel, one batch per
launch (a server request, with a cancel hook, makes at most CANCEL_TOKENS per launch: a launch
cannot be stopped once started); the engine takes it for requests that `sampling.greedy_blockers`
finds nothing against. `sample_stream` does the same for sampled requests: the kernel draws each
token as the host's sampler would (worker_sample.cuh, sampling.py), up to 64 a launch, for every
chain but a grammar and top-k off or above 64, which go one forward per token through the host's
sampler.

A model is planned for this GPU's probed worker and packed once into the package cache
(~/.cache/airframe/megakernel/packages).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ...backend import Backend, GreedyBatches, check_tokens
from ...errors import ParameterError
from ...family import ModelConfig
from ...model import Model
from ...sampling import History, Sampler
from ...options import RunOptions
from ..plan.opcodes import PLAN_VERSION, header_sha256
from ..plan.package import Package, weight_format, write_package
from ..plan.planner import SPLIT_DEFAULT
from .build import build_worker, cache_dir
from .probe import probe
from .runtime import MAX_STEPS, Device, Runtime, Worker
from .sampling import draw_settings, kernel_refuses

CANCEL_TOKENS = 2  # with a cancel hook: tokens a launch makes at most


def package_folder(model_path: Path, binary_sha256: str, ctx: int | None) -> Path:
    """Where the package of `model_path` for one worker binary and context lives in the cache (also
    keyed by the plan format version, plan_format.h, which the fingerprint names, and whether plans
    are split, so a new default replans)."""
    stat = model_path.stat()
    key = hashlib.sha256(f"{model_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{binary_sha256}|{ctx}|"
                         f"v{PLAN_VERSION}|{header_sha256()}|split={SPLIT_DEFAULT}".encode())
    return cache_dir() / "packages" / f"{model_path.stem}-{key.hexdigest()[:16]}"


class CudaBackend(Backend):
    name = "cuda"
    greedy_on_device = True
    greedy_first_token_timed = False  # the prompt runs in the launches that generate
    # greedy_stream starts every request at position 0; starting it at a kept prefix is not
    # yet checked against the VM on a GPU, so each request prefills its whole prompt
    keeps_prompt_cache = False

    def __init__(self, runtime: Runtime, config: ModelConfig):
        self.runtime = runtime
        self.config = config
        self.n_ctx = runtime.k["ctx"]
        self.n_past = 0

    @classmethod
    def load(cls, model: Model, options: RunOptions) -> "CudaBackend":
        """Open the GPU, build and probe the worker, plan and pack the model if needed, upload it.
        Of the options it takes n_ctx and progress."""
        device = Device()  # GPUError here when there is no CUDA GPU
        # a model whose matrices are all Q8_0 keeps them (the worker built for that format)
        worker = Worker(device, build_worker(device.arch, q8=weight_format(model.gguf, model.config) == "q8_0"))
        target = probe(device, worker, bandwidth=False)
        folder = package_folder(model.path, worker.build.sha256, options.n_ctx)
        if (folder / "plan.json").is_file():
            package = Package.load(folder)
        else:
            package = write_package(model.path, target, folder, ctx=options.n_ctx, progress=options.progress)
        runtime = Runtime(package, worker, options.progress)
        backend = cls(runtime, package.plan.config)
        backend.prefill_chunk = options.prefill_chunk
        return backend

    def reset(self) -> None:
        self.n_past = 0  # positions >= n_past are never read, so the cache needs no clearing

    def prefill_blocks(self, tokens: list[int], cancel: Callable[[], bool] | None = None) -> list[int] | None:
        """Run the longest run of whole prefill blocks that leaves at least the last of `tokens`
        (MAX_STEPS tokens a launch, `cancel` asked before each); returns the tokens left, or None when
        cancelled."""
        block = self.runtime.block
        whole = (len(tokens) - 1) // block * block if block else 0
        for start in range(0, whole, MAX_STEPS):
            if cancel is not None and cancel():
                return None
            run = tokens[start:min(start + MAX_STEPS, whole)]
            self.runtime.prefill(run, self.n_past)
            self.n_past += len(run)
        return tokens[whole:]

    def forward(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        tokens = [int(t) for t in check_tokens(tokens, self.n_past, self.n_ctx, self.config.vocab_size)]
        if not all_logits:
            tokens = self.prefill_blocks(tokens)
        rows = []
        for start in range(0, len(tokens), MAX_STEPS):
            chunk = tokens[start:start + MAX_STEPS]
            self.runtime.launch(chunk, self.n_past, all_logits=all_logits)
            self.n_past += len(chunk)
            if all_logits:
                rows.append(self.runtime.all_logits(len(chunk)))
        return np.concatenate(rows) if all_logits else self.runtime.logits()

    greedy_cancel = True  # greedy_stream asks cancel before each launch

    def greedy_stream(self, prompt: Sequence[int], max_new_tokens: int, eos: Sequence[int] = (),
                      cancel: Callable[[], bool] | None = None) -> GreedyBatches:
        """Greedy tokens after `prompt` (which starts a new request), one batch per launch: (ids, None)
        ..., then (ids, "stop") at an `eos` token (not included) or (ids, "length") at max_new_tokens
        or the context. With `cancel`, asked before each launch, a launch makes at most
        CANCEL_TOKENS tokens (a prompt launch still runs up to MAX_STEPS positions), so that few run
        after the client left; without it, up to MAX_STEPS."""
        if max_new_tokens < 0:
            raise ParameterError(f"max_new_tokens = {max_new_tokens}, expected >= 0")
        self.reset()
        pending = self.prefill_blocks([int(t) for t in check_tokens(prompt, 0, self.n_ctx, self.config.vocab_size)],
                                      cancel)
        if pending is None:
            return
        per_launch = MAX_STEPS if cancel is None else CANCEL_TOKENS
        made = 0
        while True:
            if cancel is not None and cancel():
                return
            if len(pending) > MAX_STEPS:  # prompt only: no token of this launch is generated
                self.runtime.launch(pending[:MAX_STEPS], self.n_past)
                self.n_past += MAX_STEPS
                pending = pending[MAX_STEPS:]
                continue
            want, room = max_new_tokens - made, self.n_ctx - self.n_past
            if want <= 0 or room < len(pending):
                yield [], "length"
                return
            steps = min(MAX_STEPS, len(pending) - 1 + min(want, per_launch), room)
            result = self.runtime.launch(pending, self.n_past, n_steps=steps, eos=eos)
            self.n_past += result.steps_done
            new = result.tokens[len(pending) - 1:]
            if result.stopped:
                yield new[:-1], "stop"
                return
            new = new[:want]
            made += len(new)
            if made >= max_new_tokens or self.n_past >= self.n_ctx:
                yield new, "length"
                return
            yield new, None
            pending = [new[-1]]

    def draw_refuses(self, sampler: Sampler) -> str | None:
        """Why the kernel cannot draw this request's tokens itself (None: it can)."""
        why = kernel_refuses(sampler)
        if why is None:
            why = self.runtime.draw_refuses(1 if sampler.chain.greedy else sampler.chain.params.top_k)
        return why

    def sample_stream(self, sampler: Sampler, history: History, tokens: Sequence[int],
                      stop_ids: Sequence[int] = ()) -> Iterator[int]:
        """Backend.sample_stream with the tokens drawn inside the kernel, up to MAX_STEPS a launch,
        which ends early at one of `stop_ids`; one forward per token where draw_refuses says why not."""
        if self.draw_refuses(sampler) is not None:
            yield from super().sample_stream(sampler, history, tokens, stop_ids)
            return
        pending = self.prefill_blocks([int(t) for t in check_tokens(tokens, self.n_past, self.n_ctx,
                                                                    self.config.vocab_size)])
        while True:
            if len(pending) > MAX_STEPS:  # prompt only: nothing drawn yet
                self.runtime.launch(pending[:MAX_STEPS], self.n_past)
                self.n_past += MAX_STEPS
                pending = pending[MAX_STEPS:]
                continue
            steps = min(MAX_STEPS, self.n_ctx - self.n_past)
            if steps < len(pending):
                return  # the context is full
            draw = draw_settings(sampler, history, steps - len(pending) + 1, self.config.vocab_size)
            result = self.runtime.launch(pending, self.n_past, n_steps=steps, eos=stop_ids, draw=draw)
            start = self.n_past
            drawn = result.tokens[len(pending) - 1:]
            for i, token in enumerate(drawn):
                sampler.accept(history, token)
                self.n_past = start + len(pending) + i  # the tokens before this one ran
                yield token
                if self.n_past >= self.n_ctx or (result.stopped and i == len(drawn) - 1):
                    return
            pending = [drawn[-1]]
