"""`airframe info MODEL [--json]`: what a GGUF file holds and what decoding it costs in bytes.

Bytes read per decoded token assume every weight is streamed once per token: all tensors except
the token embedding, the LM head (the embedding matrix itself when the head is tied) and one
embedding row. The K/V cache adds, per position of context already in it, K and V of every
layer in float32, as our backends store them; `airframe serve` allocates it at load for its
default context once per slot.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict

from ..backend import DEFAULT_CTX, DEFAULT_SLOTS, format_bytes, kv_bytes_per_position, kv_cache_bytes
from ..errors import ParameterError
from ..family import load_config
from ..gguf_file import GGUFFile
from ..models import resolve_model

HELP = "show a model's architecture, hyperparameters, quant mix, tokenizer and bytes per token"
N_LARGEST = 5


def add_arguments(p):
    p.add_argument("model", metavar="MODEL", nargs="?", help="a GGUF path or a known model name")
    p.add_argument("--gpu", action="store_true", help="list the WebGPU adapters, their limits and features")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def model_info(path) -> dict:
    """Everything `info` reports, as plain JSON-ready data."""
    gf = GGUFFile(resolve_model(path))
    try:
        config = load_config(gf)
        tensors = sorted(gf.tensors.values(), key=lambda t: -t.n_bytes)
        return {
            "path": str(gf.path),
            "file_bytes": gf.file_size,
            "gguf_version": gf.version,
            "architecture": gf.architecture,
            "name": gf.get("general.name"),
            "config": {k: v for k, v in asdict(config).items() if k != "layer_tensors"},
            "quant_mix": _quant_mix(tensors),
            "tensors": {
                "count": len(tensors),
                "bytes": sum(t.n_bytes for t in tensors),
                "largest": [{"name": t.name, "type": t.qtype.name, "shape": list(t.shape), "bytes": t.n_bytes}
                            for t in tensors[:N_LARGEST]],
            },
            "tokenizer": _tokenizer(gf),
            "decode": _decode_bytes(gf, config),
        }
    finally:
        gf.close()


def _quant_mix(tensors) -> dict:
    mix = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    for t in tensors:
        mix[t.qtype.name]["tensors"] += 1
        mix[t.qtype.name]["bytes"] += t.n_bytes
    return dict(sorted(mix.items(), key=lambda item: -item[1]["bytes"]))


def _tokenizer(gf: GGUFFile) -> dict:
    tokens = gf.get("tokenizer.ggml.tokens")
    template = gf.get("tokenizer.chat_template")
    return {
        "model": gf.get("tokenizer.ggml.model"),
        "pre": gf.get("tokenizer.ggml.pre"),
        "vocab_size": len(tokens) if isinstance(tokens, list) else None,
        "bos_id": gf.get("tokenizer.ggml.bos_token_id"),
        "eos_id": gf.get("tokenizer.ggml.eos_token_id"),
        "chat_template": isinstance(template, str) and bool(template),
    }


def _decode_bytes(gf: GGUFFile, config) -> dict:
    embd = gf.tensor("token_embd.weight")
    head = embd if config.tied_embeddings else gf.tensor("output.weight")
    others = sum(t.n_bytes for t in gf.tensors.values() if t.name not in ("token_embd.weight", "output.weight"))
    kv_per_position = kv_bytes_per_position(config)
    n_ctx = min(config.ctx_train, DEFAULT_CTX)
    return {
        "weight_bytes_per_token": others + head.n_bytes + embd.row_bytes,
        "layer_and_norm_bytes": others,
        "head_bytes": head.n_bytes,
        "embedding_row_bytes": embd.row_bytes,
        "kv_bytes_per_position": kv_per_position,
        # what `airframe serve` allocates with its defaults (--ctx, --slots), where memory allows
        "serve_kv": {"n_ctx": n_ctx, "slots": DEFAULT_SLOTS, "bytes": kv_cache_bytes(config, n_ctx, DEFAULT_SLOTS)},
    }


def format_info(info: dict) -> str:
    c, tok, dec, ts = info["config"], info["tokenizer"], info["decode"], info["tensors"]
    lines = [
        f"{info['path']} ({format_bytes(info['file_bytes'])}, GGUF v{info['gguf_version']})",
        f"architecture  {info['architecture']} (family {c['family']})" + (f", {info['name']}" if info["name"] else ""),
        "hyperparameters",
        *(f"  {key:<24}{value}" for key, value in c.items() if key not in ("family", "architecture")),
        "quant mix",
        *(f"  {name:<8}{m['tensors']:>5} tensors  {format_bytes(m['bytes']):>10}" for name, m in info["quant_mix"].items()),
        f"tensors       {ts['count']}, {format_bytes(ts['bytes'])}; largest:",
        *(f"  {t['name']:<28}{t['type']:<6}{str(t['shape']):<16}{format_bytes(t['bytes']):>10}" for t in ts["largest"]),
        f"tokenizer     {tok['model']} (pre {tok['pre']}), {tok['vocab_size']} tokens, "
        f"bos {tok['bos_id']}, eos {tok['eos_id']}, chat template: {'yes' if tok['chat_template'] else 'no'}",
        f"per decoded token  {format_bytes(dec['weight_bytes_per_token'])} of weights "
        f"(layers+norms {format_bytes(dec['layer_and_norm_bytes'])}, head {format_bytes(dec['head_bytes'])}, "
        f"embedding row {format_bytes(dec['embedding_row_bytes'])})",
        f"K/V cache          {format_bytes(dec['kv_bytes_per_position'])} per position of context (float32); "
        f"serve allocates {format_bytes(dec['serve_kv']['bytes'])} by default "
        f"({dec['serve_kv']['slots']} slots of {dec['serve_kv']['n_ctx']:,} positions)",
    ]
    return "\n".join(lines)


def run(args) -> int:
    if args.gpu:
        from ..gpu.device import describe_adapters

        print(describe_adapters())
        if args.model is None:
            return 0
    if args.model is None:
        raise ParameterError("info needs a MODEL (or --gpu)")
    info = model_info(args.model)
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0
