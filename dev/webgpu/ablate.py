"""What each op class costs inside a chained decode token: greedy chains (gpu/bench.py's
chained_decode_ms and the GPU time of a token's pass) with a chosen set of a decode token's
dispatches left out, by label (`attention` drops every layer's blk.N.attention). The tokens of a
variant that drops ops are meaningless; only their time counts. A chained token's ops are
dependent dispatches, so an op's cost here includes the wait its dependency adds, which the
per-op timestamps of `airframe bench` leave out.

    python dev/webgpu/ablate.py MODEL [--contexts 1,4096] [--variants "none;attention;ffn_gate_up,ffn_down"]
"""

from __future__ import annotations

import argparse

from airframe.backend import open_backend
from airframe.gpu import layer
from airframe.gpu.bench import GpuTimer, chained_decode_ms, chained_gpu_timeline
from airframe.gpu.device import get_context
from airframe.model import open_model
from airframe.options import RunOptions

DROPPED: list[str] = []  # label parts of the variant being timed


def _keep_undropped(dispatches):
    """LayerOps.dispatches, less a decode token's dispatches whose label holds a part in DROPPED."""
    def wrapped(self, n_tokens, n_splits, decode=None):
        out = dispatches(self, n_tokens, n_splits, decode)
        if n_tokens != 1:
            return out
        return [d for d in out if not any(part in d.label for part in DROPPED)]
    return wrapped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--contexts", default="1,4096")
    ap.add_argument("--variants", default="none;attention;qkv;attn_output;ffn_gate_up;ffn_down",
                    help="';'-separated variants, each a ','-separated list of label parts to drop, or none")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    layer.LayerOps.dispatches = _keep_undropped(layer.LayerOps.dispatches)
    options = RunOptions.from_env(n_ctx=max(contexts) + args.steps + 8, progress=False)
    be = open_backend("webgpu", open_model(args.model), options)
    timer = GpuTimer(get_context())
    for variant in args.variants.split(";"):
        DROPPED[:] = [part for part in variant.split(",") if part and part != "none"]
        be._token_lists.clear()  # the lists are cached per shape: rebuild them without the dropped ops
        cells = []
        for ctx in contexts:
            ms = chained_decode_ms(be, ctx, args.steps)
            gpu = chained_gpu_timeline(be, ctx, args.steps // 2, timer)
            cells.append(f"ctx {ctx}: {ms:.3f} ms (pass {gpu.get('pass_ms', float('nan')):.3f})")
        print(f"{variant:32s}", " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
