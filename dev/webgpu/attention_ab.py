"""Attention variants side by side: the shipped program and any experiment copies of it put in
dev/webgpu/<program>/*.wgsl, one layer's dispatch of the Llama 3.2 1B shape (32 query heads, 8 K/V
heads of 64) repeated in one pass (decode: over 16 layers' caches, which together outgrow the L2
as a token's do), GPU time per dispatch, and each variant's output against the shipped program's
(variants that drop work differ). Decode (attention_decode.wgsl, its splits combined inside): one
token at each of --positions. Prefill (attention_prefill.wgsl): a chunk of --tokens after each of --depths.

    python dev/webgpu/attention_ab.py [--positions 0,511,4095]
    python dev/webgpu/attention_ab.py --program prefill [--tokens 512] [--depths 0,4096]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from airframe.gpu import pipelines as pl
from airframe.gpu.backend import split_length
from airframe.gpu.device import get_context
from airframe.gpu.shaders import load_wgsl

HERE = Path(__file__).parent
N_HEAD, N_KV, HD, N_CTX = 32, 8, 64, 4160
LAYERS = 16  # decode: one cache per layer, as in a token: the caches together outgrow the GPU's L2


def pipeline(pipes, path: Path | None, shape: dict, program: str = "attention_decode"):
    defines = {**{k: str(v) for k, v in shape.items()}, "REDUCE": pipes.reduce,
               "HALF": "f16" if pipes.ctx.has_f16 else "f32"}
    source = load_wgsl(str(path) if path else f"{program}.wgsl", defines)
    module = pipes.device.create_shader_module(code=source)
    layout = pipes.device.create_pipeline_layout(bind_group_layouts=[pipes.layout(program)])
    return pipes.device.create_compute_pipeline(layout=layout, compute={"module": module, "entry_point": "main"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--program", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--positions", default="0,511,4095", help="decode: the token's positions")
    ap.add_argument("--split-lens", default="", help="decode: positions per split (default: the backend's choice)")
    ap.add_argument("--tokens", type=int, default=512, help="prefill: the chunk's tokens")
    ap.add_argument("--depths", default="0,4096", help="prefill: positions cached before the chunk")
    args = ap.parse_args()
    ctx = get_context()
    pipes = pl.Pipelines(ctx)
    from airframe.gpu.bench import GpuTimer, time_passes, warm_up

    timer = GpuTimer(ctx)
    rng = np.random.default_rng(0)
    if args.program == "prefill":
        return prefill(ctx, pipes, timer, rng, args.tokens, [int(d) for d in args.depths.split(",")])
    stride = (N_HEAD + 2 * N_KV) * HD
    qkv = pipes.storage(stride * 4, "qkv")
    ctx.device.queue.write_buffer(qkv, 0, rng.standard_normal(stride).astype(np.float32))
    words = pipes.storage(4096, "w")
    theta = np.outer(np.arange(N_CTX), 10000.0 ** (-np.arange(HD // 2) / (HD // 2)))
    table_data = np.stack([np.cos(theta), np.sin(theta)], -1).astype(np.float32)
    table = pipes.storage(table_data.nbytes, "table")
    ctx.device.queue.write_buffer(table, 0, table_data)
    kvs = [pipes.storage(2 * N_KV * N_CTX * HD * 4, f"kv#{i}") for i in range(LAYERS)]
    for kv in kvs:
        ctx.device.queue.write_buffer(kv, 0, rng.standard_normal(2 * N_KV * N_CTX * HD).astype(np.float32))
    part = pipes.storage(256 * N_HEAD * (HD + 4) * 4 + N_KV * 128, "part")
    arrived = pipes.storage(N_KV * 4, "arrived")
    out = pipes.storage(N_HEAD * HD * 4, "out")
    attn = pipes.uniform(pl.pack_params("attention_decode", n_head=N_HEAD, n_head_kv=N_KV, head_dim=HD, n_ctx=N_CTX,
                                        window=0, scale=HD ** -0.5, qkv_stride=stride, softcap=0.0))
    rope = pipes.uniform(pl.pack_params("rope", n_head=N_HEAD, n_head_kv=N_KV, head_dim=HD, rope_dim=HD, neox=0,
                                        qk_norm=0, q_norm_w=0, k_norm_w=0, eps=1e-5, qkv_stride=stride, n_ctx=N_CTX,
                                        table=0, qkv_bias=0, q_bias=0, k_bias=0, v_bias=0, **pl.rope_groups(stride)))
    decode_shape, _ = pl.attention_shapes(N_HEAD, N_KV, HD, int(ctx.limits["max-compute-workgroup-storage-size"]),
                                          pipes.half)
    variants = [("shipped", None)] + [(p.stem, p) for p in sorted((HERE / "attention").glob("*.wgsl"))]
    for position in (int(p) for p in args.positions.split(",")):
        lens = [int(n) for n in args.split_lens.split(",")] if args.split_lens else [split_length(position + 1, N_KV)]
        for split_len in lens:
            n_splits = -(-(position + 1) // split_len)
            rows = pipes.storage(pl.ROW_BYTES, "rows")  # one decode row: the cache at 0, its partials at 0
            ctx.device.queue.write_buffer(rows, 0, pl.pack_rows([(0, position, split_len, 0)]))
            groups = [pipes.bind("attention_decode", [qkv, words, table, kv, part, out, attn, rope, rows, arrived])
                      for kv in kvs]
            reference = None
            for name, path in variants:
                program = pipeline(pipes, path, decode_shape)
                layers = [pl.Dispatch(name, program, g, (n_splits, N_KV, 1)) for g in groups]
                warm_up(ctx, timer, layers, 0.2)
                t = time_passes(ctx, timer, layers, 20) / LAYERS
                got = np.frombuffer(ctx.device.queue.read_buffer(out), np.float32).copy()
                reference = got if reference is None else reference
                diff = float(np.abs(got - reference).max())
                print(f"position {position:5} ({n_splits:3} splits of {split_len:4}): {name:12} {t * 1e6:7.2f} us a "
                      f"dispatch, max difference from shipped {diff:.2e}")


def prefill(ctx, pipes, timer, rng, tokens: int, depths: list[int]) -> None:
    from airframe.gpu.bench import time_passes, warm_up

    stride = (N_HEAD + 2 * N_KV) * HD
    n_ctx = max(depths) + tokens
    qkv = pipes.storage(tokens * stride * 4, "qkv")
    ctx.device.queue.write_buffer(qkv, 0, rng.standard_normal(tokens * stride).astype(np.float32))
    kv = pipes.storage(2 * N_KV * n_ctx * HD * 4, "kv")
    ctx.device.queue.write_buffer(kv, 0, rng.standard_normal(2 * N_KV * n_ctx * HD).astype(np.float32))
    out = pipes.storage(tokens * N_HEAD * HD * 4, "out")
    attn = pipes.uniform(pl.pack_params("attention_decode", n_head=N_HEAD, n_head_kv=N_KV, head_dim=HD, n_ctx=n_ctx,
                                        window=0, scale=HD ** -0.5, qkv_stride=stride, softcap=0.0))
    _, shape = pl.attention_shapes(N_HEAD, N_KV, HD, int(ctx.limits["max-compute-workgroup-storage-size"]),
                                   pipes.half)
    variants = [("shipped", None)] + [(p.stem, p) for p in sorted((HERE / "attention_prefill").glob("*.wgsl"))]
    grid = (pl.ceil_div(tokens * N_HEAD // N_KV, 64), N_KV, 1)
    for depth in depths:
        step = pipes.uniform(pl.pack_step(depth, tokens, 0, 0))
        group = pipes.bind("attention_prefill", [qkv, kv, out, attn, step])
        keys = tokens * (depth + (tokens + 1) / 2)  # causal: keys summed over the chunk's tokens
        reference = None
        for name, path in variants:
            d = pl.Dispatch(name, pipeline(pipes, path, shape, "attention_prefill"), group, grid)
            warm_up(ctx, timer, [d] * 2, 0.3)
            t = time_passes(ctx, timer, [d] * 2, 3) / 2
            got = np.frombuffer(ctx.device.queue.read_buffer(out), np.float32).copy()
            reference = got if reference is None else reference
            diff = float(np.abs(got - reference).max())
            tflops = 4 * N_HEAD * HD * keys / t / 1e12
            print(f"depth {depth:5} ({tokens} tokens): {name:12} {t * 1e3:8.3f} ms a dispatch, {tflops:5.2f} TFLOP/s, "
                  f"max difference from shipped {diff:.2e}")


if __name__ == "__main__":
    main()
