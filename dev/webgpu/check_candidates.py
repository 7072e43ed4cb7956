"""candidates.wgsl on this machine's adapter against its numpy reference at real vocabulary sizes and
draw.wgsl against the host's sampler, then the sampled path (one token at a time, and chained on the
GPU) against the full logits over 200 tokens per setting on a GGUF file.

    python dev/webgpu/check_candidates.py /tmp/l1b_Q4_K_M.gguf
"""

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from gpu_helpers import SAMPLED, both_ways, chained, reduce_reference  # noqa: E402

from airframe.gpu import candidates as cand  # noqa: E402
from airframe.gpu import pipelines as pl  # noqa: E402
from airframe.gpu.backend import WebGPUBackend  # noqa: E402
from airframe.gpu.device import get_context  # noqa: E402
from airframe.model import open_model  # noqa: E402
from airframe.options import RunOptions  # noqa: E402
from airframe.sampling import History, Sampler  # noqa: E402


def kernel(vocab: int) -> None:
    ctx = get_context()
    pipes = pl.Pipelines(ctx)
    be = SimpleNamespace(pipes=pipes, ctx=ctx, config=SimpleNamespace(vocab_size=vocab),
                         scratch=SimpleNamespace(logits=pipes.storage(vocab * 4, "logits"), ids=pipes.storage(16, "ids")))
    ops = cand.build_candidates(be)
    rng = np.random.default_rng(vocab)
    drawn = 0
    for scale in (0.01, 1.0, 30.0):
        for params in SAMPLED:
            logits = (scale * rng.standard_normal(vocab)).astype(np.float32)
            history = History(list(rng.integers(0, vocab, 64)), n_prompt=32)
            sampler = Sampler(params, vocab)
            reduction = sampler.reduction(history, cand.PEN_MAX - 1, cand.MAX_WANT)
            ctx.device.queue.write_buffer(be.scratch.logits, 0, logits)
            cand.write_request(be, ops, reduction)
            ctx.device.queue.submit([cand.record(be, ops)])
            found = cand.read(be, ops, reduction)
            got, want = found.candidates, reduce_reference(logits, reduction)
            assert got.ids.tolist() == want.ids.tolist(), (vocab, scale)
            assert got.logits.tolist() == want.logits.tolist() and got.threshold == want.threshold
            assert abs(got.log_sum_exp - want.log_sum_exp) <= 1e-5 * max(1.0, abs(want.log_sum_exp))
            assert found.drawn == sampler.sample_reduced(history, got), (vocab, scale, params)
            drawn += found.drawn is not None
    print(f"candidates.wgsl, vocabulary {vocab}: {3 * len(SAMPLED)} cases equal the numpy reference; "
          f"draw.wgsl drew the host's token in {drawn}, left the others to the host as it does")


def sampled_path(path: str, n: int = 200) -> None:
    be = WebGPUBackend.load(open_model(path), RunOptions(n_ctx=1024))
    prompt = list(range(1, 17))
    for params in SAMPLED:
        started = time.perf_counter()
        decided, fallbacks = both_ways(be, prompt, params, n)
        print(f"{path}: {n} tokens equal to full-logits sampling ({decided} from candidates, {fallbacks} "
              f"fell back) in {time.perf_counter() - started:.1f} s: {params}")
        want = chained(be, prompt, params, n, on_gpu=False)
        assert chained(be, prompt, params, n) == want, params
        print(f"{path}: {n} tokens chained on the GPU equal to full-logits sampling")


if __name__ == "__main__":
    print(get_context().name)
    for vocab in (49152, 128256, 262144):
        kernel(vocab)
    for path in sys.argv[1:]:
        sampled_path(path)
