"""Packing weights: layer buffers, the row-chunk plan, and Gemma 3's 178 MB embedding really split on lavapipe."""

import numpy as np
import pytest

from airframe.errors import UnsupportedError
from airframe.gguf_file import GGUFFile
from airframe.gpu.device import get_context
from airframe.gpu.pack import TENSOR_ALIGN_WORDS, pack_tensors, plan_row_chunks
from airframe.gpu.backend import WebGPUBackend
from airframe.model import open_model
from airframe.models import resolve_model
from airframe.options import RunOptions
from airframe.reference import ReferenceBackend


@pytest.mark.parametrize("rows,row_bytes,binding,buffer,align", [
    (262144, 720, 128 << 20, (2 << 30) - 1, 32),   # Gemma 3 Q8_0 embedding on lavapipe
    (128256, 4096, 2 << 30, 4 << 30, 256),         # Llama 3.2 1B BF16 head on the H200: one chunk
    (256000, 9216, 2 << 30, 4 << 30, 256),         # a 2.4 GB head: two chunks, two buffers
    (1000, 36, 5000, 12000, 256),                  # rows that straddle the alignment
])
def test_plan_row_chunks(rows, row_bytes, binding, buffer, align):
    plan = plan_row_chunks(rows, row_bytes, binding, buffer, align)
    assert sum(n for _, _, _, n in plan) == rows
    expected_first = 0
    for index, offset, first, n in plan:
        assert first == expected_first
        expected_first += n
        assert offset % align == 0
        assert n * row_bytes <= binding
        assert offset + n * row_bytes <= buffer


def test_plan_row_chunks_rejects_a_row_bigger_than_a_binding():
    with pytest.raises(UnsupportedError, match="does not fit one binding"):
        plan_row_chunks(10, 4096, 1024, 1 << 20, 256)


def test_layer_pack_offsets():
    """Every tensor of a layer in one buffer, at aligned word offsets, in GGUF names."""
    gf = GGUFFile(resolve_model("smollm2-135m"))
    names = [f"blk.3.{t}" for t in ("attn_norm.weight", "attn_q.weight", "ffn_down.weight")]
    pack = pack_tensors(get_context(), gf, names, "blk.3")
    offsets = [pack[n].offset for n in names]
    assert offsets == sorted(offsets) and all(o % TENSOR_ALIGN_WORDS == 0 for o in offsets)
    q = pack["blk.3.attn_q.weight"]
    assert (q.rows, q.cols, q.row_words) == (576, 576, 576 // 32 * 5)
    assert pack.n_words * 4 <= pack.buffer.size


def test_gemma_embedding_is_split_on_the_binding_limit():
    """The 178 MB Q8_0 table exceeds lavapipe's 128 MiB binding: tokens on both sides of the cut agree."""
    model = open_model("gemma3-270m")
    gpu = WebGPUBackend.load(model, RunOptions(n_ctx=8))
    chunks = gpu.token_embd.chunks
    assert len(chunks) > 1
    assert all(c.size <= get_context().max_binding for c in chunks)
    cut = chunks[1].first_row
    tokens = [cut - 1, cut, 2, 262143]
    got = gpu.forward(tokens, all_logits=True)
    want = ReferenceBackend.load(model, RunOptions(n_ctx=8)).forward(tokens, all_logits=True)
    assert (got.argmax(1) == want.argmax(1)).all()
    np.testing.assert_allclose(got, want, atol=0.02)
