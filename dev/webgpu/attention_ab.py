"""Decode attention variants side by side: shaders/attention_decode.wgsl and any experiment copies
of it put in dev/webgpu/attention/*.wgsl, one dispatch per layer of the Llama 3.2 1B shape (32
query heads, 8 K/V heads of 64) repeated in one pass, GPU time per dispatch at several positions,
and each variant's output against the shipped kernel's (variants that drop work differ).

    python dev/webgpu/attention_ab.py [--positions 0,511,4095]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from airframe.gpu import pipelines as pl
from airframe.gpu.device import get_context
from airframe.gpu.shaders import load_wgsl

HERE = Path(__file__).parent
N_HEAD, N_KV, HD, N_CTX = 32, 8, 64, 4160


def pipeline(pipes, path: Path | None, shape: dict):
    defines = {**{k: str(v) for k, v in shape.items()}, "REDUCE": pipes.reduce}
    source = load_wgsl(str(path) if path else "attention_decode.wgsl", defines)
    module = pipes.device.create_shader_module(code=source)
    layout = pipes.device.create_pipeline_layout(bind_group_layouts=[pipes.layout("attention_decode")])
    return pipes.device.create_compute_pipeline(layout=layout, compute={"module": module, "entry_point": "main"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", default="0,511,4095")
    args = ap.parse_args()
    ctx = get_context()
    pipes = pl.Pipelines(ctx)
    from airframe.gpu.bench import GpuTimer, time_passes, warm_up

    timer = GpuTimer(ctx)
    rng = np.random.default_rng(0)
    stride = (N_HEAD + 2 * N_KV) * HD
    qkv = pipes.storage(stride * 4, "qkv")
    ctx.device.queue.write_buffer(qkv, 0, rng.standard_normal(stride).astype(np.float32))
    words = pipes.storage(4096, "w")
    theta = np.outer(np.arange(N_CTX), 10000.0 ** (-np.arange(HD // 2) / (HD // 2)))
    table_data = np.stack([np.cos(theta), np.sin(theta)], -1).astype(np.float32)
    table = pipes.storage(table_data.nbytes, "table")
    ctx.device.queue.write_buffer(table, 0, table_data)
    kv = pipes.storage(2 * N_KV * N_CTX * HD * 4, "kv")
    ctx.device.queue.write_buffer(kv, 0, rng.standard_normal(2 * N_KV * N_CTX * HD).astype(np.float32))
    part = pipes.storage(256 * N_HEAD * (HD + 2) * 4, "part")
    out = pipes.storage(N_HEAD * HD * 4, "out")
    attn = pipes.uniform(pl.pack_params("attention_decode", n_head=N_HEAD, n_head_kv=N_KV, head_dim=HD, n_ctx=N_CTX,
                                        window=0, scale=HD ** -0.5, qkv_stride=stride, softcap=0.0))
    rope = pipes.uniform(pl.pack_params("rope", n_head=N_HEAD, n_head_kv=N_KV, head_dim=HD, rope_dim=HD, neox=0,
                                        qk_norm=0, q_norm_w=0, k_norm_w=0, eps=1e-5, qkv_stride=stride, n_ctx=N_CTX,
                                        table=0, qkv_bias=0, q_bias=0, k_bias=0, v_bias=0))
    decode_shape, _ = pl.attention_shapes(N_HEAD, N_KV, HD, int(ctx.limits["max-compute-workgroup-storage-size"]))
    variants = [("shipped", None)] + [(p.stem, p) for p in sorted((HERE / "attention").glob("*.wgsl"))]
    for position in (int(p) for p in args.positions.split(",")):
        per_split = max(-(-(position + 1) // (512 // N_KV)), 64)
        split_len = -(-per_split // 64) * 64
        n_splits = -(-(position + 1) // split_len)
        step = pipes.uniform(pl.pack_step(position, 1, 0, split_len))
        group = pipes.bind("attention_decode", [qkv, words, table, kv, part, out, attn, rope, step])
        reference = None
        for name, path in variants:
            d = pl.Dispatch(name, pipeline(pipes, path, decode_shape), group, (n_splits, N_KV, 1))
            warm_up(ctx, timer, [d] * 16, 0.2)
            t = time_passes(ctx, timer, [d] * 16, 20) / 16
            got = np.frombuffer(ctx.device.queue.read_buffer(part), np.float32).copy()
            reference = got if reference is None else reference
            diff = float(np.abs(got - reference).max())
            print(f"position {position:5} ({n_splits:3} splits): {name:12} {t * 1e6:7.2f} us a dispatch, "
                  f"max difference from shipped {diff:.2e}")


if __name__ == "__main__":
    main()
