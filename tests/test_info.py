"""`airframe info` on the two real models: its numbers agree with the file and with each other."""

from __future__ import annotations

import json

import pytest

from airframe.cli import main
from airframe.commands.info import model_info
from airframe.family import load_config
from airframe.gguf_file import GGUFFile
from airframe.models import resolve_model


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_info_json_is_consistent_with_the_file(name, capsys):
    assert main(["info", name, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    gf = GGUFFile(resolve_model(name))
    config = load_config(gf)
    assert info["architecture"] == gf.architecture and info["config"]["family"] == config.family
    assert info["config"]["n_layers"] == config.n_layers and info["config"]["vocab_size"] == config.vocab_size
    total = sum(t.n_bytes for t in gf.tensors.values())
    assert info["tensors"] == {**info["tensors"], "count": len(gf.tensors), "bytes": total}
    assert sum(m["bytes"] for m in info["quant_mix"].values()) == total
    assert sum(m["tensors"] for m in info["quant_mix"].values()) == len(gf.tensors)
    largest = info["tensors"]["largest"]
    assert largest[0]["name"] == "token_embd.weight"  # 49,152 or 262,144 rows: by far the largest
    assert [t["bytes"] for t in largest] == sorted((t["bytes"] for t in largest), reverse=True)
    assert info["tokenizer"]["vocab_size"] == len(gf.get("tokenizer.ggml.tokens"))
    assert info["tokenizer"]["chat_template"] == ("tokenizer.chat_template" in gf.metadata)
    decode = info["decode"]
    # Tied head: every tensor once (the embedding as the head) plus one embedding row.
    embd = gf.tensors["token_embd.weight"]
    assert decode["weight_bytes_per_token"] == total + embd.row_bytes
    assert decode["kv_bytes_per_position"] == config.n_layers * config.n_head_kv * (config.head_dim + config.head_dim_v) * 4
    serve = decode["serve_kv"]  # what `airframe serve` allocates by default: every slot's cache
    assert serve["bytes"] == serve["slots"] * serve["n_ctx"] * decode["kv_bytes_per_position"]
    assert serve["n_ctx"] == min(config.ctx_train, 4096) and serve["slots"] == 2


def test_info_text(capsys):
    assert main(["info", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert "architecture  llama (family llama)" in out
    assert "chat template: yes" in out and "Q4_1" in out and "per decoded token" in out


def test_untied_head_counts_the_output_matrix(tmp_path):
    from gguf import GGUFWriter
    import numpy as np

    w = GGUFWriter(str(tmp_path / "untied.gguf"), "llama")
    for key, value in {"block_count": 1, "embedding_length": 8, "feed_forward_length": 16,
                       "attention.head_count": 2}.items():
        w.add_uint32(f"llama.{key}", value)
    shapes = {"token_embd.weight": (5, 8), "output.weight": (5, 8), "output_norm.weight": (8,),
              **{f"blk.0.{n}.weight": s for n, s in {
                  "attn_norm": (8,), "attn_q": (8, 8), "attn_k": (8, 8), "attn_v": (8, 8),
                  "attn_output": (8, 8), "ffn_norm": (8,), "ffn_gate": (16, 8), "ffn_up": (16, 8),
                  "ffn_down": (8, 16)}.items()}}
    for name, shape in shapes.items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = model_info(tmp_path / "untied.gguf")
    assert not info["config"]["tied_embeddings"]
    total = sum(4 * int(np.prod(s)) for s in shapes.values())
    embd_bytes, row = 4 * 5 * 8, 4 * 8
    assert info["decode"]["head_bytes"] == 4 * 5 * 8
    assert info["decode"]["weight_bytes_per_token"] == total - embd_bytes + row
    assert info["tokenizer"]["vocab_size"] is None and info["tokenizer"]["chat_template"] is False


def test_info_of_a_missing_model(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nothing.gguf")]) == 1
    assert "no model file" in capsys.readouterr().err
