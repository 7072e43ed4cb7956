"""The backend seam: one check of token ids and context for every backend, and the backend by name."""

import numpy as np
import pytest

from airframe.backend import check_tokens, open_backend
from airframe.errors import ContextOverflowError, GGUFError, ParameterError
from airframe.model import open_model
from airframe.options import RunOptions


def test_ids_that_fit_come_back_as_int64():
    ids = check_tokens([3, np.uint32(4), 9], n_past=2, n_ctx=5, vocab_size=10)
    assert ids.dtype == np.int64 and ids.tolist() == [3, 4, 9]


@pytest.mark.parametrize("tokens,message", [
    ([], r"token ids of shape \(0,\), expected a non-empty 1-D sequence"),
    ([[1, 2]], r"token ids of shape \(1, 2\), expected a non-empty 1-D sequence"),
    ([[1], [2, 3]], "uneven nesting"),
    ([1.5], "token ids of type float64, expected integers"),
    ([True], "token ids of type bool, expected integers"),
    ([4, 10], "token id 10 is outside the vocabulary 0..9"),
    ([-2, 3], "token id -2 is outside the vocabulary 0..9"),
])
def test_bad_ids_are_parameter_errors(tokens, message):
    with pytest.raises(ParameterError, match=message) as raised:
        check_tokens(tokens, n_past=0, n_ctx=8, vocab_size=10)
    assert not isinstance(raised.value, ContextOverflowError)


def test_ids_that_do_not_fit_are_a_context_overflow():
    with pytest.raises(ContextOverflowError, match=r"5 cached \+ 4 new positions = 9 do not fit in the context of 8"):
        check_tokens([1, 2, 3, 4], n_past=5, n_ctx=8, vocab_size=10)


def test_an_unknown_backend_is_named(smollm2_path):
    with pytest.raises(ParameterError, match="unknown backend 'metal'; choose one of webgpu, reference, cuda"):
        open_backend("metal", open_model(smollm2_path), RunOptions())


@pytest.mark.parametrize("backend", ["reference", "webgpu"])
def test_a_context_beyond_memory_is_refused_before_allocating(smollm2_path, backend):
    import resource
    import time

    model = open_model(smollm2_path)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(ParameterError) as raised:
        open_backend(backend, model, RunOptions(n_ctx=999_999_999))
    message = str(raised.value)
    assert time.perf_counter() - start < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB: nothing was allocated
    # 30 layers x 3 K/V heads x (64 + 64) dims x 4 bytes = 46,080 bytes per position
    assert "a context of 999,999,999 positions needs " in message
    assert f"{46_080 * 999_999_999:,} bytes: " in message if backend == "reference" else "GiB RoPE tables" in message
    assert "of memory are available; expected a context of at most" in message


def test_the_memory_check_follows_an_address_space_limit(smollm2_path):
    """Under `ulimit -v` the limit, not the machine's memory, bounds the context."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()

    def limited():
        import resource

        from airframe.backend import available_memory

        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * 4096
        resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 28), resource.RLIM_INFINITY))
        child.send(available_memory())

    proc = ctx.Process(target=limited)
    proc.start()
    proc.join(30)
    assert parent.recv() <= 1 << 28


def test_positions_beyond_int32_are_refused(smollm2_path):
    with pytest.raises(ParameterError, match=r"context = 4,294,967,296 positions, expected at most 2,147,483,647"):
        open_backend("cuda", open_model(smollm2_path), RunOptions(n_ctx=1 << 32))


def test_check_tensors_names_the_damaged_tensor(tmp_path):
    from airframe.gguf_file import GGUFFile
    from airframe.synthetic import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "nan.gguf", "llama", "tiny", "Q8_0")
    model = open_model(path)
    backend = open_backend("reference", model, RunOptions(n_ctx=16, check_tensors=True))  # a clean file loads
    assert backend.n_ctx == 16
    with GGUFFile(path) as gf:
        norm, matrix = gf.tensor("blk.1.ffn_norm.weight"), gf.tensor("blk.0.attn_k.weight")
    data = bytearray(path.read_bytes())
    data[norm.offset + 8:norm.offset + 12] = np.float32(np.nan).tobytes()
    (tmp_path / "norm.gguf").write_bytes(bytes(data))
    data = bytearray(path.read_bytes())
    at = matrix.offset + 3 * matrix.row_bytes + 34  # the f16 scale of row 3's second Q8_0 block
    data[at:at + 2] = np.float16(np.inf).tobytes()
    (tmp_path / "scale.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"tensor 'blk.1.ffn_norm.weight' \(F32 \[64\]\) has a value that is NaN "
                                        r"or infinite in row 0 of 1; expected finite weights"):
        open_backend("reference", open_model(tmp_path / "norm.gguf"), RunOptions(n_ctx=16, check_tensors=True))
    with pytest.raises(GGUFError, match=r"tensor 'blk.0.attn_k.weight' \(Q8_0 \[64, 32\]\) has a block scale that "
                                        r"is NaN or infinite in row 3 of 32"):
        open_backend("reference", open_model(tmp_path / "scale.gguf"), RunOptions(n_ctx=16, check_tensors=True))
    assert open_backend("reference", open_model(tmp_path / "scale.gguf"), RunOptions(n_ctx=16)).n_ctx == 16


def test_scale_fields_are_where_gguf_reads_scales():
    """Each SCALE_FIELDS offset holds an f16 that makes gguf's own dequantization non-finite."""
    from gguf import GGML_QUANT_SIZES
    from airframe.gguf_file import dequantize_rows
    from airframe.tensor_check import SCALE_FIELDS

    rng = np.random.default_rng(0)
    for qtype, offsets in SCALE_FIELDS.items():
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(1, size), dtype=np.uint8)
        for at in offsets:
            raw[0, at:at + 2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
        assert np.isfinite(dequantize_rows(raw, qtype)).all(), qtype.name
        for at in offsets:
            bad = raw.copy()
            bad[0, at:at + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
            assert not np.isfinite(dequantize_rows(bad, qtype)).all(), (qtype.name, at)


@pytest.mark.parametrize("command", [["run", "{path}", "Hi", "-n", "1"], ["perplexity", "{path}", "-f", "{text}"]])
def test_check_tensors_on_the_command_line(tmp_path, capsys, command):
    from airframe.cli import main
    from airframe.gguf_file import GGUFFile
    from airframe.synthetic import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "nan.gguf", "llama", "tiny", "Q8_0")
    with GGUFFile(path) as gf:
        norm = gf.tensor("output_norm.weight")
    data = bytearray(path.read_bytes())
    data[norm.offset:norm.offset + 4] = np.float32(np.inf).tobytes()
    path.write_bytes(bytes(data))
    (tmp_path / "text.txt").write_text("one two three four five six seven eight nine ten " * 20)
    argv = [a.format(path=path, text=tmp_path / "text.txt") for a in command] + ["--backend", "reference", "--ctx", "32"]
    assert main(argv + ["--check-tensors"]) == 1
    err = capsys.readouterr().err
    assert "airframe: error: " in err and "tensor 'output_norm.weight' (F32 [64]) has a value that is NaN or infinite" in err


def test_the_default_slots_fit_in_memory_and_more_are_refused_with_the_numbers(monkeypatch):
    import airframe.backend as backend
    from airframe.backend import DEFAULT_SLOTS, check_memory, kv_cache_bytes, memory_needed, slot_count

    config = open_model("smollm2-135m").config
    options = RunOptions(n_ctx=1024, slots=None)  # the default airframe serve asks for
    two = sum(memory_needed("reference", config, 1024, options, DEFAULT_SLOTS).values())
    monkeypatch.setattr(backend, "available_memory", lambda: two)
    assert slot_count("reference", config, options) == DEFAULT_SLOTS
    assert memory_needed("reference", config, 1024, options, 3)["K/V cache"] == kv_cache_bytes(config, 1024, 3)
    with pytest.raises(ParameterError, match=r"^3 slots of 1,024 positions need .* expected at most 2 slots of 1,024 "
                                             r"positions, or a context of at most \d+ positions$"):
        check_memory("reference", config, RunOptions(n_ctx=1024, slots=3))
    monkeypatch.setattr(backend, "available_memory", lambda: two - 1)
    assert slot_count("reference", config, options) == 1  # the default shrinks where two do not fit
    assert slot_count("cuda", config, options) == 1
    assert slot_count("reference", config, RunOptions(n_ctx=1024, slots=None, prompt_cache=False)) == 1
    assert slot_count("reference", config, RunOptions()) == 1  # other commands run one conversation
    with pytest.raises(ParameterError, match="2 slots with the cuda backend, expected 1"):
        check_memory("cuda", config, RunOptions(slots=2))
    with pytest.raises(ParameterError, match=r"slots = 0, expected an integer >= 1 or None"):
        RunOptions(slots=0)
