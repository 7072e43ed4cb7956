"""The CUDA megakernel on a machine without a GPU: the worker compiles for sm_86 and sm_90, the
host's picture of its argument structs matches the compiled one, the runtime's host logic (task
cells, shared memory, the greedy launch loop) works on a scripted stand-in for the GPU, and
opening the backend without a CUDA GPU gives a clear error. On-GPU checks are in
scripts/megakernel_device_check.py (docs/MEGAKERNEL.md, "CUDA worker")."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from airframe.errors import ContextOverflowError, GPUError, NonFiniteError, ParameterError, UnsupportedError
from airframe.family import ModelConfig
from airframe.megakernel.cuda import bench, build, runtime
from airframe.megakernel.cuda import sampling as ks
from airframe.megakernel.cuda.backend import CudaBackend
from airframe.megakernel.plan.opcodes import HEADER_PATH, Op
from airframe.megakernel.plan.planner import make_plan
from airframe.megakernel.plan.target import NAMED_TARGETS
from airframe.model import open_model
from airframe.options import RunOptions
from airframe.sampling import History, Sampler, SamplingParams, greedy_blockers
from scripts_loader import load_script

NVCC = build.find_nvcc()
LLAMA_1B = ModelConfig(family="llama", architecture="llama", n_layers=16, n_embd=2048, n_ff=8192, n_head=32,
                       n_head_kv=8, head_dim=64, head_dim_v=64, rope_dim=64, rope_base=500000.0, rms_eps=1e-5,
                       ctx_train=131072, vocab_size=128256, tied_embeddings=True)
SMOL = replace(LLAMA_1B, n_layers=30, n_embd=576, n_ff=1536, n_head=9, n_head_kv=3, vocab_size=49152)


def gpu_present() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ---- compiling ------------------------------------------------------------------------------------
# both weight formats: the shipped BF16 worker and the Q8_0 one (AF_Q8), whose quants, scales and
# the blocks of ffn_down hold more values in the hot loops under the same 64 registers
FORMATS = pytest.mark.parametrize("q8", [False, True], ids=["bf16", "q8"])
# the worker's and its calls' spill stores at most: the calls into the drawing code leave a few
# values spilled at the launch's start and reloaded once per task, outside every loop (0-20 B by
# compiler and architecture; docs/MEGAKERNEL.md, "Registers"); the merges as calls keep the rest free
SPILL_BUDGET = 24


@FORMATS
@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_worker_compiles_with_nvcc(arch, q8, tmp_path):
    assert NVCC, "nvcc is expected on PATH (CI has CUDA 13)"
    out = tmp_path / f"worker_{arch}.o"
    done = subprocess.run(build.nvcc_command(NVCC, arch, build.SOURCE_PATH, out, kind="-c", q8=q8),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = build.parse_ptxas(done.stdout + done.stderr)
    assert 0 < report["registers"] <= 64  # __launch_bounds__(1024, 1): one 1024-thread block per SM
    assert report["spill_stores"] <= SPILL_BUDGET
    prefill = build.parse_ptxas(done.stdout + done.stderr, build.PREFILL_KERNEL)
    assert 0 < prefill["registers"] <= 64 and prefill["spill_stores"] <= SPILL_BUDGET
    assert out.stat().st_size > 10_000


@FORMATS
@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_worker_compiles_with_nvrtc(arch, q8):
    # the build path of a machine without nvcc: NVRTC has no C library headers, so plan_format.h
    # and worker.cu bring their own fixed-width types, offsetof and INFINITY (and the Q8 worker
    # its own f16 conversion)
    cubin, log = build._compile_nvrtc(arch, q8=q8)
    report = build.parse_ptxas(log)
    assert 0 < report["registers"] <= 64
    assert report["spill_stores"] <= SPILL_BUDGET
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 10_000


def test_build_is_cached_by_source_and_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFRAME_CACHE", str(tmp_path))
    first = build.build_worker("sm_90")
    cubin = Path(first.path)
    stamp = cubin.stat().st_mtime_ns
    again = build.build_worker("sm_90")
    assert again == first and cubin.stat().st_mtime_ns == stamp  # from the cache, not rebuilt
    assert len(first.sha256) == 64 and first.registers <= 64
    assert "registers" in first.summary() and "spill" in first.summary()


def test_build_key_covers_every_included_file(tmp_path, monkeypatch):
    # an edit to any file worker.cu includes must not be served a cached cubin of the old source
    key = build._key("sm_90", "nvcc 13.0")
    for path in (build.HEADER_PATH, *build.PART_PATHS):
        edited = tmp_path / path.name
        edited.write_bytes(path.read_bytes() + b"\n// edited\n")
        if path == build.HEADER_PATH:
            monkeypatch.setattr(build, "HEADER_PATH", edited)
        else:
            monkeypatch.setattr(build, "PART_PATHS", tuple(edited if p == path else p for p in build.PART_PATHS))
        assert build._key("sm_90", "nvcc 13.0") != key, path.name
        monkeypatch.undo()
    included = {line.split('"')[1] for f in (build.SOURCE_PATH, *build.PART_PATHS)
                for line in f.read_text().splitlines() if line.startswith('#include "')}
    assert included == {build.HEADER_PATH.name, *(p.name for p in build.PART_PATHS)}


def test_weight_format_is_a_build_setting():
    # the Q8 worker is another binary: its own -D, its own cache entry, and a Build that says so;
    # a report cached before the setting existed loads as the BF16 build it was
    assert build.defines() == () and build.defines(q8=True) == ("AF_Q8=1",)
    assert build.defines(3, q8=True) == ("AF_TRACE_MARK=3", "AF_Q8=1")
    assert build._key("sm_90", "nvcc 13.0", q8=True) != build._key("sm_90", "nvcc 13.0")
    assert "-DAF_Q8=1" in build.nvcc_command("nvcc", "sm_90", build.SOURCE_PATH, Path("w.cubin"), q8=True)
    old = dict(arch="sm_90", compiler="nvcc 13.0", sha256="0" * 64, registers=64, spill_stores=0, spill_loads=0,
               stack_bytes=0, shared_static=32, path="w.cubin")
    assert build.Build(**old).q8 is False
    assert " q8 " in build.Build(**old, q8=True).summary() and " q8 " not in build.Build(**old).summary()


def test_bad_arch_is_refused():
    with pytest.raises(ParameterError, match="sm_86"):
        build.build_worker("compute_90; rm -rf /")


PTXAS_LOG = """ptxas info    : Compiling entry function 'af_worker' for 'sm_90'
ptxas info    : Function properties for af_worker
    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 16 bytes smem
ptxas info    : Function properties for _Z15merge_attentionRK7af_argsjjPf
    16 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads
"""


def test_parse_ptxas_adds_the_spills_of_called_functions():
    report = build.parse_ptxas(PTXAS_LOG)
    assert report == {"stack_bytes": 8, "spill_stores": 20, "spill_loads": 24, "registers": 64, "shared_static": 16}


def test_parse_ptxas_keeps_the_prefill_kernels_callees_apart():
    log = PTXAS_LOG + """ptxas info    : Function properties for af_prefill
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 16 bytes smem
ptxas info    : Function properties for _Z6pf_ffnRK7af_argsRK7af_taskPfS5_S5_b
    0 bytes stack frame, 24 bytes spill stores, 8 bytes spill loads
"""
    assert build.parse_ptxas(log)["spill_stores"] == 20  # af_worker: its own and merge_attention's
    assert build.parse_ptxas(log, build.PREFILL_KERNEL)["spill_stores"] == 12 + 24


def test_parse_ptxas_names_the_missing_kernel():
    with pytest.raises(GPUError, match="af_worker"):
        build.parse_ptxas("ptxas info : Compiling entry function 'other' for 'sm_90'")


def run_host_program(tmp_path, source: str, defines: tuple[str, ...] = ()) -> list[int]:
    """Compile `source` (a main() that includes worker.cu) for the host, with the build settings
    `defines` (build.defines), and return the integers it prints."""
    assert NVCC, "nvcc is expected on PATH (CI has CUDA 13)"
    src = tmp_path / "main.cu"
    src.write_text(source)
    exe = tmp_path / "main"
    cmd = [NVCC, "-arch=sm_90", "-std=c++17", *(f"-D{d}" for d in defines), "-I", str(build.SOURCE_PATH.parent),
           "-I", str(HEADER_PATH.parent), str(src), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]


LAYOUT_MAIN = r"""
#include <cstdio>
#include <cstddef>
#include "worker.cu"
int main() {
    printf("%zu %zu %zu %zu %zu %zu %zu %zu %d %d\n", sizeof(af_args), sizeof(af_plan_consts), offsetof(af_args, tasks),
           offsetof(af_args, ffn_max_rows), offsetof(af_plan_consts, rope_cos), sizeof(af_control),
           offsetof(af_control, steps_done), offsetof(af_args, sides), AF_THREADS, AF_FFN_COPIES);
    return 0;
}
"""


def test_host_layout_matches_the_compiled_structs(tmp_path):
    found = run_host_program(tmp_path, LAYOUT_MAIN)
    rt = runtime
    assert found == [rt.ARGS_DTYPE.itemsize, rt.CONSTS_DTYPE.itemsize, rt.ARGS_DTYPE.fields["tasks"][1],
                     rt.ARGS_DTYPE.fields["ffn_max_rows"][1], rt.CONSTS_DTYPE.fields["rope_cos"][1],
                     4 * rt.CONTROL_WORDS, 4 * rt.CONTROL_FIELDS["steps_done"], rt.ARGS_DTYPE.fields["sides"][1],
                     rt.THREADS, rt.FFN_COPIES]  # the thread count and FFN sum copies af_layout reports


SAMPLING_MAIN = r"""
#include <cstdio>
#include <cstddef>
#include "worker.cu"
int main() {
    printf("%zu\n", sizeof(af_sampling));
""" + "".join(f'    printf("%zu\\n", offsetof(af_sampling, {f}));\n' for f in ks.SAMPLING_DTYPE.names) + r"""
    printf("%d %d\n", AF_SAMPLE_K, AF_SAMPLE_SHARED_FLOATS);
    return 0;
}
"""


def test_host_sampling_settings_match_the_compiled_struct(tmp_path):
    found = run_host_program(tmp_path, SAMPLING_MAIN)
    dtype = ks.SAMPLING_DTYPE
    assert found == [dtype.itemsize, *(dtype.fields[f][1] for f in dtype.names), ks.SAMPLE_K, ks.SAMPLE_SHARED_FLOATS]


CONTROL_FIELDS_IN_ORDER = ("n_steps", "pos0", "n_forced", "n_eos", "eos", "trace_step", "hold_pos", "tokens_in",
                           "steps_done", "error", "stopped", "error_step", "tokens_out")
CONTROL_MAIN = r"""
#include <cstdio>
#include <cstddef>
#include "worker.cu"
int main() {
""" + "".join(f'    printf("%zu\\n", offsetof(af_control, {f}));\n' for f in CONTROL_FIELDS_IN_ORDER) + r"""
    return 0;
}
"""


def test_host_control_words_match_the_compiled_struct(tmp_path):
    # every field the host writes or reads in af_control (hold_pos: the benchmarks' fixed position)
    found = run_host_program(tmp_path, CONTROL_MAIN)
    assert dict(zip(CONTROL_FIELDS_IN_ORDER, (v // 4 for v in found))) == runtime.CONTROL_FIELDS


XS_MAIN = r"""
#include <cstdio>
#include "worker.cu"
int main() {
    printf("%u %u\n", (unsigned)AF_XS_PLANE_FLOATS, (unsigned)AF_XS_STEP);
    for (uint32_t i = 0; i < 4096; ++i) printf("%u\n", xs_index(i));
    return 0;
}
"""


# (attn_chunk, attn_chunks, attn_spread, attn_min, attn_wide, attn_wide_min, positions): the H200's
# and RTX 3050's Llama 1B plans, SmolLM2's on the H200, fixed chunks, a wider spread without the
# wide regime, an uneven granularity, the device check's 4160-position plan with another wide
# minimum, and a small wide one
SPAN_CASES = ((256, 16, 4, 32, 16, 128, 4096), (2048, 2, 4, 32, 16, 128, 4096), (95, 44, 4, 32, 16, 128, 4160),
              (256, 16, 0, 32, 16, 128, 4096), (128, 32, 8, 24, 0, 128, 4096), (64, 4, 4, 32, 16, 128, 256),
              (260, 16, 4, 32, 16, 96, 4160), (32, 8, 4, 32, 8, 16, 256))
SPAN_MAIN = r"""
#include <cstdio>
#include "worker.cu"
int main() {
    const unsigned cases[][7] = {CASES};
    for (const auto& k : cases) {
        af_plan_consts c{};
        c.attn_chunk = k[0];
        c.attn_chunks = k[1];
        c.attn_spread = k[2];
        c.attn_min = k[3];
        c.attn_wide = k[4];
        c.attn_wide_min = k[5];
        for (unsigned pos = 0; pos < k[6]; ++pos) printf("%u\n", attn_span(c, pos));
    }
    return 0;
}
"""


def test_worker_spans_the_attention_as_the_planner_says(tmp_path):
    # the worker's attn_span (compiled for the host from its own source) against opcodes.attn_span,
    # the rule the VM follows, at every position of several plans
    from airframe.megakernel.plan.opcodes import attn_span

    cases = ", ".join("{" + ", ".join(str(v) for v in case) + "}" for case in SPAN_CASES)
    found = run_host_program(tmp_path, SPAN_MAIN.replace("CASES", cases))
    want = [attn_span(dict(attn_chunk=c, attn_chunks=n, attn_spread=s, attn_min=m, attn_wide=w, attn_wide_min=wm),
                      pos)
            for c, n, s, m, w, wm, positions in SPAN_CASES for pos in range(positions)]
    assert found == want
    assert len(set(want)) > 10  # spans that move with the position, not only the fixed chunks


def test_xs_layout_gives_every_lane_its_two_halves(tmp_path):
    # where the worker keeps element i of the vector a GEMV multiplies (two planes), compiled for
    # the host from the worker's own source and checked against the layout dot8 and the norm read
    out = run_host_program(tmp_path, XS_MAIN)
    plane, step, where = out[0], out[1], np.array(out[2:])
    i = np.arange(4096)
    j, e = i // 8, i % 8
    # dot8 reads vector j's elements 0-3 at xs + step * j and 4-7 at xs + plane + step * j
    assert np.array_equal(where, np.where(e < 4, step * j + e, plane + step * j + e - 4))
    assert len(set(where.tolist())) == 4096 and where.max() < 2 * runtime.XS_PLANE_FLOATS
    # lanes l = 0..31 reading vectors l (a warp's float4 loads): 32 consecutive 16-byte words
    first = where[8 * np.arange(32)]
    assert plane == runtime.XS_PLANE_FLOATS and step == 4 and np.array_equal(np.diff(first), np.full(31, 4))


F16_MAIN = r"""
#include <cstdio>
#include <cstring>
#include "worker.cu"
static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
int main() {
    for (uint32_t h = 0; h < 65536; ++h) printf("%u\n", bits(f16_float(h)));
    return 0;
}
"""


def test_f16_scales_widen_exactly(tmp_path):
    # the Q8 worker's own f16 -> f32 (bit by bit: NVRTC has no cuda_fp16.h), compiled for the host,
    # against numpy at every one of the 65,536 patterns: normals, subnormals, +-0, inf and NaN
    found = np.array(run_host_program(tmp_path, F16_MAIN, build.defines(q8=True)), dtype=np.uint32)
    want = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(found.view(np.float32)), nan) and nan.sum() == 2 * 1023
    assert np.array_equal(found[~nan], want[~nan].view(np.uint32))


Q8_K, Q8_ROWS, Q8_E, Q8_FF = 96, 3, 64, 64  # a row of 3 blocks (10 bytes of padding); 2 ffn_down blocks
Q8_MAIN = r"""
#include <cstdio>
#include <cstring>
#include "worker.cu"
static const uint8_t rows[] = {@ROWS@};
static const uint8_t down[] = {@DOWN@};
static uint2 quants(const uint8_t* p) {
    uint2 q;
    memcpy(&q, p, 8);
    return q;
}
static uint32_t half_at(const uint8_t* p) { return p[0] | (uint32_t)p[1] << 8; }
static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
int main() {
    const uint32_t k = @K@, e = @E@;
    printf("%u %u %u %u\n", q8_row_bytes(k), q8_row_bytes(2048), q8_row_bytes(8192), (unsigned)q8_down_block(e, 32));
    for (uint32_t r = 0; r < @NROWS@; ++r) {  // as gemv_list: vector g of a row, the scale of its block
        const uint8_t* row = rows + r * q8_row_bytes(k);
        for (uint32_t g = 0; g < k / 8; ++g) {
            const float scale = f16_float(half_at(row + q8_scale_at(k, g)));
            for (uint32_t i = 0; i < 8; ++i) printf("%u\n", bits(q8_weight(scale, quants(row + 8 * g), i)));
        }
    }
    for (uint32_t f = 0; f < @NFF@; ++f) {  // as op_ffn: row f's 8 columns of col, their 8 scales
        const uint8_t* block = down + q8_down_block(e, f);
        for (uint32_t col = 0; col < e / 8; ++col)
            for (uint32_t i = 0; i < 8; ++i) {
                const float scale = f16_float(half_at(block + q8_down_scales(e, col) + 2 * i));
                printf("%u\n", bits(q8_weight(scale, quants(block + q8_down_quants(e, f, col)), i)));
            }
    }
    return 0;
}
"""


def test_q8_weights_decode_as_the_vm(tmp_path):
    # bytes laid out as planner.WEIGHT_FORMATS says (numpy, random quants and finite f16 scales, a
    # subnormal and a -0 among them), read back through the worker's own offsets and q8_weight:
    # every weight must be f32(scale) * f32(q), the exact F32 value the VM dequantizes to
    from airframe.megakernel.plan.planner import q8_down_block_bytes, q8_row_bytes

    rng = np.random.default_rng(8)

    def halves(n):  # finite f16: any sign and mantissa, exponent 0..30
        bits = rng.integers(0, 0x7C00, n, dtype=np.uint16) | (rng.integers(0, 2, n, dtype=np.uint16) << 15)
        return bits.view(np.float16)

    q = rng.integers(-128, 128, (Q8_ROWS, Q8_K), dtype=np.int8)
    s = halves(Q8_ROWS * Q8_K // 32).reshape(Q8_ROWS, Q8_K // 32)
    s.view(np.uint16)[0, 1] = 0x0001  # the smallest subnormal
    rb = q8_row_bytes(Q8_K)
    rows = np.zeros((Q8_ROWS, rb), np.uint8)
    rows[:, :Q8_K] = q.view(np.uint8)
    rows[:, Q8_K:Q8_K + Q8_K // 16] = s.view(np.uint8)
    dq = rng.integers(-128, 128, (Q8_FF, Q8_E), dtype=np.int8)  # ffn_down, transposed: (n_ff, n_embd)
    ds = halves(Q8_FF // 32 * Q8_E).reshape(Q8_FF // 32, Q8_E)  # one scale per block and column
    ds.view(np.uint16)[1, 5], ds.view(np.uint16)[0, 7] = 0x83FF, 0x8000  # a subnormal, -0
    down = np.concatenate([np.concatenate([dq[32 * b:32 * b + 32].view(np.uint8).ravel(), ds[b].view(np.uint8)])
                           for b in range(Q8_FF // 32)])
    assert down.size == Q8_FF // 32 * q8_down_block_bytes(Q8_E)
    source = Q8_MAIN
    for name, value in (("ROWS", ", ".join(map(str, rows.ravel()))), ("DOWN", ", ".join(map(str, down))),
                        ("K", Q8_K), ("E", Q8_E), ("NROWS", Q8_ROWS), ("NFF", Q8_FF)):
        source = source.replace(f"@{name}@", str(value))
    out = run_host_program(tmp_path, source, build.defines(q8=True))
    assert out[:4] == [rb, q8_row_bytes(2048), q8_row_bytes(8192), q8_down_block_bytes(Q8_E)]
    found = np.array(out[4:], dtype=np.uint32).view(np.float32)
    want_rows = q.astype(np.float32) * np.repeat(s.astype(np.float32), 32, axis=1)
    want_down = dq.astype(np.float32) * np.repeat(ds.astype(np.float32), 32, axis=0)
    n = Q8_ROWS * Q8_K
    assert np.array_equal(found[:n].view(np.uint32), want_rows.ravel().view(np.uint32))
    assert np.array_equal(found[n:].view(np.uint32), want_down.ravel().view(np.uint32))


def test_vectors_longer_than_xs_are_refused():
    plan = make_plan(LLAMA_1B, NAMED_TARGETS["h200"], ctx=4160)
    runtime.check_model_limits(dict(plan.consts, n_embd=4096))
    with pytest.raises(UnsupportedError, match="vectors of 8192"):
        runtime.check_model_limits(dict(plan.consts, n_embd=8192))


# ---- no GPU here ----------------------------------------------------------------------------------
@pytest.mark.skipif(gpu_present(), reason="this machine has a CUDA GPU: the no-GPU error cannot happen")
def test_no_cuda_gpu_is_a_clear_error(smollm2_path):
    with pytest.raises(GPUError, match="CUDA"):
        CudaBackend.load(open_model(smollm2_path), RunOptions())


def test_missing_cuda_bindings_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda", None)
    with pytest.raises(GPUError, match="cuda-bindings"):
        runtime.driver()


def test_open_backend_routes_cuda_to_the_megakernel(monkeypatch, smollm2_path):
    from airframe.backend import open_backend

    seen = {}
    monkeypatch.setattr(CudaBackend, "load", classmethod(lambda cls, model, options: seen.update(model=model)))
    model = open_model(smollm2_path)
    open_backend("cuda", model, RunOptions())
    assert seen["model"] is model


def test_sampling_options_the_kernel_cannot_honour():
    # the engine hands the in-kernel greedy loop only requests greedy_blockers finds nothing against
    assert greedy_blockers(SamplingParams(temperature=0.0)) == []
    assert any("temperature" in b for b in greedy_blockers(SamplingParams(temperature=0.7)))
    assert any("repeat_penalty" in b for b in greedy_blockers(SamplingParams(temperature=0.0, repeat_penalty=1.1)))
    assert any("logit_bias" in b for b in greedy_blockers(SamplingParams(temperature=0.0, logit_bias={3: 1.0})))


# ---- host logic -----------------------------------------------------------------------------------
def control_words(error: int, error_step: int) -> np.ndarray:
    ctl = np.zeros(runtime.CONTROL_WORDS, dtype=np.uint32)
    ctl[runtime.CONTROL_FIELDS["error"]], ctl[runtime.CONTROL_FIELDS["error_step"]] = error, error_step
    return ctl


def test_the_error_word_becomes_a_non_finite_error_naming_the_position():
    runtime.check_error_word(control_words(0, 0), pos0=10)  # no error bit: nothing to say
    with pytest.raises(NonFiniteError, match=r"a non-finite logit at position 13 \(step 3 of the launch\)"):
        runtime.check_error_word(control_words(runtime.ERROR_NON_FINITE, 3), pos0=10)
    with pytest.raises(NonFiniteError, match="FFN output .* at position 10 "):
        runtime.check_error_word(control_words(runtime.ERROR_FFN_RANGE, 3), pos0=10, hold_pos=True)


def fake_worker(sha: str, arch: str = "sm_90", sm_count: int = 132, shared_optin: int = 227 * 1024):
    device = SimpleNamespace(arch=arch, sm_count=sm_count, shared_optin=shared_optin, name="fake")
    build = SimpleNamespace(sha256=sha, arch=arch, compiler="nvcc 13.0", q8=False)
    return SimpleNamespace(build=build, device=device, static_shared=16, threads=1024, prefill_kernel="af_prefill",
                           blocks_per_sm=lambda shared, kernel=None: 1)


def test_runtime_refuses_packages_made_for_another_worker_or_gpu():
    plan = make_plan(SMOL, replace(NAMED_TARGETS["h200"], binary_sha256="a" * 64), ctx=256)
    package = SimpleNamespace(plan=plan)
    with pytest.raises(runtime.PlanError, match="worker binary a{64}, this GPU runs b{64}"):
        runtime.Runtime(package, fake_worker("b" * 64))
    with pytest.raises(runtime.PlanError, match="made for sm_90, this GPU is sm_86"):
        runtime.Runtime(package, fake_worker("a" * 64, arch="sm_86"))
    with pytest.raises(runtime.PlanError, match="132 workers, this GPU holds 20"):
        runtime.Runtime(package, fake_worker("a" * 64, sm_count=20))
    with pytest.raises(runtime.UnsupportedError, match="shared memory"):
        runtime.Runtime(package, fake_worker("a" * 64, shared_optin=16 * 1024))



def test_task_cells_index_every_wave_and_worker():
    plan = make_plan(SMOL, replace(NAMED_TARGETS["rtx3050"], workers=20), ctx=512)
    k, tasks = plan.consts, plan.tasks
    cells = runtime.task_cells(tasks, k["n_waves"], 20)
    assert cells[0] == 0 and cells[-1] == len(tasks) and np.all(np.diff(cells.astype(np.int64)) >= 0)
    for w in (0, 2, k["n_waves"] - 1):
        for worker in (0, 7, 19):
            got = tasks[cells[w * 20 + worker]:cells[w * 20 + worker + 1]]
            assert np.all(got["wave"] == w) and np.all(got["worker"] == worker)
    with pytest.raises(runtime.PlanError, match="sorted"):
        runtime.task_cells(tasks[::-1], k["n_waves"], 20)


@pytest.mark.parametrize("workers", [20, 132])
def test_shared_memory_fits_both_gpus(workers):
    plan = make_plan(LLAMA_1B, replace(NAMED_TARGETS["h200"], workers=workers), ctx=4160)
    ffn = plan.tasks[plan.tasks["opcode"] == Op.FFN]
    need = 4 * runtime.shared_floats(plan.consts, int(ffn["row_count"].max()))
    scores = 4 * plan.consts["attn_chunk"] * 4  # four query heads' scores over one chunk
    assert 4 * 2048 + scores < need <= 99 * 1024  # RTX 3050 opt-in limit; H200 allows 227 KiB


def test_side_bits_name_the_side_vectors_a_plan_writes():
    whole = make_plan(LLAMA_1B, NAMED_TARGETS["h200"], ctx=4160, split=False)
    assert runtime.side_bits(whole.tasks) == 0  # the worker then adds 0.0f instead of reading zeros
    tasks = whole.tasks.copy()
    qkv = np.flatnonzero(tasks["opcode"] == Op.QKV)[0]
    tasks["side"][qkv] = 1
    assert runtime.side_bits(tasks) == 1
    wo = np.flatnonzero(tasks["opcode"] == Op.WO)[0]
    tasks["side"][wo] = 1
    assert runtime.side_bits(tasks) == 3
    split = make_plan(LLAMA_1B, NAMED_TARGETS["h200"], ctx=4160, split=True)
    assert runtime.side_bits(split.tasks) == 3  # 3072 QKV and 2048 WO rows over 132 workers both split


def test_unsupported_shapes_are_named():
    k = make_plan(SMOL, NAMED_TARGETS["h200"], ctx=256).consts
    runtime.check_model_limits(k)
    with pytest.raises(UnsupportedError, match="head_dim = 80"):
        runtime.check_model_limits(dict(k, head_dim=80))
    with pytest.raises(UnsupportedError, match="query heads per K/V head"):
        runtime.check_model_limits(dict(k, n_head=36, n_head_kv=2))
    # the FFN's 64-bit sums fill two slots a copy (AF_FFN_COPIES, 2), and 512 partials below 2^22
    # cannot overflow them
    assert runtime.FFN_COPIES == 2
    for parts in (1, 3, 513):
        with pytest.raises(UnsupportedError, match="ffn_parts"):
            runtime.check_model_limits(dict(k, ffn_parts=parts))
    with pytest.raises(UnsupportedError, match="ffn_parts = 3, expected 4..512"):
        runtime.check_model_limits(dict(k, ffn_parts=3))
    runtime.check_model_limits(dict(k, ffn_parts=4))


@FORMATS
@pytest.mark.parametrize("mark", [1, 9])
def test_trace_mark_builds_compile(mark, q8):
    # the diagnostic builds the device check traces beside the worker (--phases): 1 stamps the
    # prologues, 9 waits for the FFN's atomics (a fence and a block barrier more)
    cubin, log = build._compile_nvcc(NVCC, "sm_90", mark, q8)
    assert build.parse_ptxas(log)["spill_stores"] <= SPILL_BUDGET and cubin[:4] == b"\x7fELF"
    with pytest.raises(ParameterError, match="trace mark 10"):
        build.build_worker("sm_90", trace_mark=10)


@pytest.mark.parametrize("target,workers,limit", [("h200", 132, 227 * 1024), ("rtx3050", 20, 99 * 1024)])
def test_staged_merge_room_fits_both_gpus(target, workers, limit):
    # merge_staged: every chunk's (m, l, o) records of all query heads, their scales and sums
    plan = make_plan(LLAMA_1B, replace(NAMED_TARGETS[target], workers=workers), ctx=4160)
    k = plan.consts
    rows = int(plan.tasks[plan.tasks["opcode"] == Op.FFN]["row_count"].max())
    records = k["attn_chunks"] * k["n_head"] * (k["head_dim_v"] + 2)
    plain, staged = (4 * runtime.shared_floats(k, rows, stage=s) for s in (False, True))
    assert staged >= 4 * (2 * runtime.XS_PLANE_FLOATS + 64 + records + k["n_head"] * (k["attn_chunks"] + 2))
    assert plain <= staged <= limit  # 16 chunks of 260 positions on the H200: 135 KiB of records


def test_floor_of_llama_1b_bf16():
    plan = make_plan(LLAMA_1B, NAMED_TARGETS["h200"], ctx=4160)
    norms = 33 * 2048  # 2 per layer and the output norm: BF16 in the checkpoint, F32 in the package
    assert bench.weight_bytes_per_token(plan) == 2_471_628_800 + 2 * norms  # Llama 3.2 1B in BF16
    assert bench.kv_bytes(plan.consts, 4096) == 268_435_456  # F32 K/V, 64 KiB per position
    assert bench.floor_ms(plan, 1, 4530.0) == pytest.approx(0.5456, abs=1e-3)
    ideal = bench.wave_ideal_ns(plan, 0, 4530.0)  # ns per wave, from the planner's bytes per task
    assert ideal.sum() * 4530.0 == pytest.approx(2_471_628_800, rel=0.02)
    assert ideal[-1] * 4530.0 == pytest.approx(128256 * 2048 * 2, rel=1e-6)  # lm_head streams the embedding


class ScriptedRuntime:
    """Stands in for Runtime: token t is followed by (3 t + 1) % vocab; logits one-hot. With
    `block`, prompts' whole blocks go through `prefill`, which records them."""

    def __init__(self, ctx=300, vocab=50, block=0):
        self.k = {"ctx": ctx, "vocab": vocab}
        self.block = block
        self.launches = []
        self.prefills = []
        self.last = None

    def prefill(self, tokens, pos0):
        assert self.block and len(tokens) % self.block == 0 and 0 < len(tokens) <= 64
        assert pos0 + len(tokens) <= self.k["ctx"]
        self.prefills.append((list(tokens), pos0))
        return 1.0

    def successor(self, t):
        return (3 * t + 1) % self.k["vocab"]

    def launch(self, tokens, pos0, n_steps=None, eos=(), all_logits=False, trace_step=None):
        n_steps = len(tokens) if n_steps is None else n_steps
        assert 1 <= n_steps <= 64 and len(tokens) <= n_steps and pos0 + n_steps <= self.k["ctx"]
        self.launches.append((list(tokens), pos0, n_steps))
        out, feed = [], list(tokens)
        for step in range(n_steps):
            token = feed[step] if step < len(tokens) else out[-1]
            out.append(self.successor(token))
            self.last = out[-1]
            if step + 1 >= len(tokens) and out[-1] in eos:
                return runtime.LaunchResult(step + 1, out, True)
        self.rows = np.eye(self.k["vocab"], dtype=np.float32)[out]
        return runtime.LaunchResult(n_steps, out, False)

    def logits(self):
        return np.eye(self.k["vocab"], dtype=np.float32)[self.last]

    def all_logits(self, steps):
        return self.rows[:steps]


def scripted_backend(ctx=300, block=0) -> CudaBackend:
    return CudaBackend(ScriptedRuntime(ctx, block=block), SMOL)


def expected_chain(start, n, vocab=50):
    out, t = [], start
    for _ in range(n):
        t = (3 * t + 1) % vocab
        out.append(t)
    return out


def test_generate_greedy_spans_launches_and_positions():
    backend = scripted_backend()
    prompt = list(range(5, 75))  # 70 tokens: one prompt-only launch of 64, then the rest
    tokens, reason = backend.generate_greedy(prompt, 100)
    assert reason == "length" and tokens == expected_chain(prompt[-1], 100)
    launches = backend.runtime.launches
    assert launches[0] == (prompt[:64], 0, 64)
    assert [(pos, n) for _, pos, n in launches] == [(0, 64), (64, 64), (128, 41)]
    assert backend.n_past == 70 + 100 - 1  # the last token is never fed


def test_generate_greedy_stops_at_eos_inside_the_launch():
    backend = scripted_backend()
    chain = expected_chain(4, 20)
    tokens, reason = backend.generate_greedy([4], 50, eos=[chain[6]])
    assert reason == "stop" and tokens == chain[:6]
    assert len(backend.runtime.launches) == 1


def test_greedy_stream_is_generate_greedy_in_one_batch():
    """The engine's declared on-device method: every token at the end, so no time to the first token."""
    backend = scripted_backend()
    assert backend.greedy_on_device and not backend.greedy_first_token_timed
    chain = expected_chain(4, 20)
    assert list(backend.greedy_stream([4], 50, eos=[chain[6]])) == [(chain[:6], "stop")]
    assert list(backend.greedy_stream([4], 5)) == [(chain[:5], "length")]


def test_with_a_cancel_hook_a_launch_makes_at_most_two_tokens_and_none_starts_after_it():
    backend = scripted_backend()
    prompt = list(range(5, 75))  # one prompt-only launch of 64, then the rest with the first tokens
    launches = backend.runtime.launches
    left_after = 3  # the client leaves while the third launch runs
    batches = list(backend.greedy_stream(prompt, 100, cancel=lambda: len(launches) >= left_after))
    assert len(launches) == left_after
    assert [(len(tokens), n) for tokens, _, n in launches] == [(64, 64), (6, 7), (1, 2)]
    assert batches == [(expected_chain(prompt[-1], 2), None), (expected_chain(prompt[-1], 4)[2:], None)]
    uncancelled = scripted_backend()
    assert list(uncancelled.greedy_stream(prompt, 100, cancel=lambda: False))[-1][1] == "length"
    assert uncancelled.generate_greedy(prompt, 100)[0] == expected_chain(prompt[-1], 100)


class DrawingRuntime(ScriptedRuntime):
    """ScriptedRuntime whose logits after token t are a fixed random row of t, and whose launches
    draw as the kernel does (sampling.KernelDraw over two LM_HEAD slots of 25 rows)."""

    SLOTS = [(0, 25), (25, 25)]

    def row(self, t):
        return np.random.default_rng(t).normal(scale=2.0, size=self.k["vocab"]).astype(np.float32)

    def draw_refuses(self, top_k):
        return None if top_k <= 25 else f"top_k = {top_k} is more than an LM_HEAD task's 25 rows"

    def launch(self, tokens, pos0, n_steps=None, eos=(), all_logits=False, trace_step=None, draw=None):
        n_steps = len(tokens) if n_steps is None else n_steps
        assert 1 <= n_steps <= 64 and len(tokens) <= n_steps and pos0 + n_steps <= self.k["ctx"]
        self.launches.append((list(tokens), pos0, n_steps, draw is not None))
        first = len(tokens) - 1
        picture = ks.KernelDraw(draw, self.SLOTS, first) if draw is not None else None
        out, rows = [], []
        for step in range(n_steps):
            rows.append(self.row(tokens[step] if step < len(tokens) else out[-1]))
            if picture is not None and step >= first:
                out.append(picture.token(step, rows[-1]))
                picture.advance(step, out[-1])
            else:
                out.append(int(np.argmax(rows[-1])))
            if step >= first and out[-1] in eos:
                return runtime.LaunchResult(step + 1, out, True)
        self.rows = np.stack(rows)
        self.last_row = rows[-1]
        return runtime.LaunchResult(n_steps, out, False)

    def logits(self):
        return self.last_row


def host_tokens(params, prompt, n, vocab=50):
    """What the host's sampler draws over DrawingRuntime's logits."""
    rt = DrawingRuntime(vocab=vocab)
    sampler = Sampler(params, vocab)
    history = History(list(prompt), n_prompt=len(prompt))
    for _ in range(n):
        sampler.accept(history, sampler.sample(history, rt.row(history.tokens[-1])))
    return history.generated


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=20, repeat_penalty=1.3, seed=3),
                                    SamplingParams(temperature=0.0, presence_penalty=1.5, seed=4)],
                         ids=["sampled", "greedy with a penalty"])
def test_sample_stream_draws_in_launches_of_64(params):
    backend = CudaBackend(DrawingRuntime(), SMOL)
    prompt = [t % 50 for t in range(5, 75)]  # one prompt-only launch of 64, then the rest with the first tokens
    sampler, history = Sampler(params, 50), History(list(prompt), n_prompt=len(prompt))
    stream = backend.sample_stream(sampler, history, prompt)
    tokens = [next(stream) for _ in range(130)]
    assert tokens == history.generated == host_tokens(params, prompt, 130)
    assert [(pos, n, drawn) for _, pos, n, drawn in backend.runtime.launches] == [
        (0, 64, False), (64, 64, True), (128, 64, True), (192, 64, True)]
    assert backend.n_past == 70 + 130 - 1  # the tokens before the last one yielded ran
    stream.close()


def test_sample_stream_prefills_whole_blocks_of_the_prompt():
    params = SamplingParams(temperature=0.9, top_k=20, repeat_penalty=1.3, seed=3)
    rt = DrawingRuntime()
    rt.block = 8
    backend = CudaBackend(rt, SMOL)
    prompt = [t % 50 for t in range(5, 75)]  # 64 tokens prefilled, the last 6 in the first drawing launch
    sampler, history = Sampler(params, 50), History(list(prompt), n_prompt=len(prompt))
    stream = backend.sample_stream(sampler, history, prompt)
    tokens = [next(stream) for _ in range(20)]
    assert tokens == host_tokens(params, prompt, 20)
    assert rt.prefills == [(prompt[:64], 0)] and rt.launches[0][:3] == (prompt[64:], 64, 64)
    stream.close()


def test_sample_stream_stops_after_a_stop_id_and_at_the_context():
    params = SamplingParams(temperature=0.9, top_k=20, seed=3)
    want = host_tokens(params, [1, 2], 40)
    backend = CudaBackend(DrawingRuntime(), SMOL)
    tokens = list(backend.sample_stream(Sampler(params, 50), History([1, 2], n_prompt=2), [1, 2], stop_ids=[want[9]]))
    assert tokens == want[:want.index(want[9]) + 1] and len(backend.runtime.launches) == 1
    short = CudaBackend(DrawingRuntime(ctx=30), SMOL)
    tokens = list(short.sample_stream(Sampler(params, 50), History([1, 2], n_prompt=2), [1, 2]))
    assert tokens == want[:29] and short.n_past == 30


def test_sample_stream_leaves_what_the_kernel_refuses_to_the_host():
    params = SamplingParams(temperature=0.9, top_k=40, seed=3)  # more than a slot's 25 rows
    backend = CudaBackend(DrawingRuntime(), SMOL)
    stream = backend.sample_stream(Sampler(params, 50), History([1, 2], n_prompt=2), [1, 2])
    tokens = [next(stream) for _ in range(5)]
    assert tokens == host_tokens(params, [1, 2], 5)
    assert all(not drawn for *_, drawn in backend.runtime.launches) and len(backend.runtime.launches) == 5


class WideDrawingRuntime(DrawingRuntime):
    """DrawingRuntime over 200 ids in two slots of 100 rows: room for the device check's top_k 64."""

    SLOTS = [(0, 100), (100, 100)]

    def __init__(self):
        super().__init__(vocab=200)

    def clear_kv(self):
        pass


class StepIndexedRuntime(WideDrawingRuntime):
    """Draws with the random number of the launch's step instead of its drawn token's: after a
    prompt of several tokens, each draw takes a number meant for a later one."""

    def launch(self, tokens, pos0, n_steps=None, eos=(), all_logits=False, trace_step=None, draw=None):
        first = len(tokens) - 1
        if draw is not None and first:
            u = draw.header[0]["u"]
            u[:len(u) - first] = u[first:].copy()
        return super().launch(tokens, pos0, n_steps, eos, all_logits, trace_step, draw)


def test_device_check_sampled_section_finds_draws_unlike_the_hosts():
    """scripts/megakernel_device_check.py's sampled section: every chain of a faithful drawing
    runtime passes; a runtime that indexes its random numbers by step fails, naming the chains."""
    module = load_script("megakernel_device_check")
    rows = module.sampled(WideDrawingRuntime())
    assert set(rows) == {label for label, _ in module.SAMPLED}
    assert all(r["n_host_mismatches"] == 0 and r["three_runs_identical"] for r in rows.values())
    with pytest.raises(AssertionError, match="default\\+repeat") as failed:
        module.sampled(StepIndexedRuntime())
    assert "greedy+repeat" not in str(failed.value)  # no random number, nothing to get wrong


def test_bad_token_ids_are_parameter_errors():
    backend = scripted_backend()
    with pytest.raises(ParameterError, match="outside the vocabulary 0..49151"):
        backend.forward([49152])
    with pytest.raises(ParameterError, match="non-empty"):
        backend.generate_greedy([], 4)


def test_generate_greedy_ends_at_the_context():
    backend = scripted_backend(ctx=40)
    tokens, reason = backend.generate_greedy([1, 2, 3], 100)
    assert reason == "length" and len(tokens) == 40 - 3 + 1 and backend.n_past == 40


def test_forward_in_launches_of_64():
    backend = scripted_backend()
    rows = backend.forward(list(range(100)) + [3], all_logits=True)
    assert rows.shape == (101, 50) and backend.n_past == 101
    assert int(np.argmax(rows[-1])) == 10  # successor of 3
    assert [n for _, _, n in backend.runtime.launches] == [64, 37]
    last = backend.forward([7])
    assert int(np.argmax(last)) == 22 and backend.n_past == 102
    with pytest.raises(ContextOverflowError, match="300"):
        backend.forward([1] * 199)
    backend.reset()
    assert backend.n_past == 0


def test_prompts_take_whole_prefill_blocks_and_decode_the_rest():
    backend = scripted_backend(block=8)
    prompt = list(range(5, 205))  # 200 tokens: 192 in three prefill launches, the last 8 decoded
    tokens, reason = backend.generate_greedy(prompt, 10)
    assert reason == "length" and tokens == expected_chain(prompt[-1], 10)
    rt = backend.runtime
    assert rt.prefills == [(prompt[0:64], 0), (prompt[64:128], 64), (prompt[128:192], 128)]
    assert rt.launches[0][:2] == (prompt[192:], 192)
    short = scripted_backend(block=8)
    short.generate_greedy([1, 2, 3, 4, 5, 6, 7, 8], 2)  # 8 tokens: no whole block before the last
    assert short.runtime.prefills == [] and short.runtime.launches[0][0] == [1, 2, 3, 4, 5, 6, 7, 8]
    nine = scripted_backend(block=8)
    assert int(np.argmax(nine.forward(list(range(1, 10))))) == (3 * 9 + 1) % 50
    assert nine.runtime.prefills == [(list(range(1, 9)), 0)] and nine.runtime.launches == [([9], 8, 1)]
    assert nine.n_past == 9
    rows = nine.forward(list(range(20)), all_logits=True)  # every position's logits: decode steps
    assert rows.shape == (20, 50) and len(nine.runtime.prefills) == 1


def test_a_cancelled_request_stops_between_prefill_launches():
    backend = scripted_backend(block=8)
    rt = backend.runtime
    batches = list(backend.greedy_stream(list(range(200)), 10, cancel=lambda: len(rt.prefills) >= 2))
    assert batches == [] and len(rt.prefills) == 2 and rt.launches == []


def test_prefill_shared_memory_fits_the_h200_not_the_rtx_3050():
    plan = make_plan(LLAMA_1B, replace(NAMED_TARGETS["h200"], workers=132), ctx=4160)
    ffn = plan.tasks[plan.tasks["opcode"] == Op.FFN]
    rows = int(ffn["row_count"].max())
    need = 4 * runtime.prefill_shared_floats(plan.consts, rows)
    assert runtime.BLOCK * 4 * 4096 < need <= 227 * 1024 - 16 * 1024  # the task table fits beside it
    assert need > 99 * 1024  # an RTX 3050 runs prompts token by token
    table, _ = runtime.table_floats(plan.tasks, plan.consts["n_waves"], 132)
    rt = runtime.Runtime.__new__(runtime.Runtime)
    rt.k, rt.ffn_max_rows, rt.workers = plan.consts, rows, 132
    for optin, block in ((227 * 1024, runtime.BLOCK), (99 * 1024, 0)):
        rt.worker = fake_worker("a" * 64, shared_optin=optin)
        rt.device = rt.worker.device
        rt.prefill_layout(table)
        assert rt.block == block
    rt.k = dict(plan.consts, n_embd=248)  # pf_down keeps a column's row groups in one warp: 32 columns of 8
    rt.prefill_layout(table)
    assert rt.block == 0


# ---- trace ----------------------------------------------------------------------------------------
def fake_trace(plan, workers: int) -> dict:
    """Every task 1 us long, 0.1 us after the last barrier; each barrier releases 0.5 us after it."""
    tasks = []
    release = np.zeros((plan.consts["n_waves"], workers), dtype=np.int64)
    for i, task in enumerate(plan.tasks):
        w = int(task["wave"])
        start = int(release[w - 1].max()) + 100 if w else 0
        tasks.append([i, start, start + 1000])
        release[w] = start + 1500
    return {"format": "airframe-megakernel-trace", "version": 1, "fingerprint": plan.fingerprint["fingerprint"],
            "position": 1, "time_unit": "ns", "tasks": tasks, "wave_release_ns": release.tolist()}


def test_trace_breakdown_and_timeline(tmp_path):
    plan = make_plan(replace(SMOL, n_layers=2), replace(NAMED_TARGETS["rtx3050"], workers=20), ctx=256)
    trace = fake_trace(plan, 20)
    parts = bench.breakdown(trace, plan, 200.0)
    n_waves = plan.consts["n_waves"]
    assert parts["token_us"] == pytest.approx(n_waves * 1.6 - 0.1)
    assert sum(d["waves"] for d in parts["by_kind"].values()) == n_waves
    assert parts["barrier_after_last_task_us"] == pytest.approx(n_waves * 0.5)
    assert set(parts["by_kind"]) == {"embed", "qkv", "attn", "wo", "ffn", "ffn_reduce", "final_norm", "lm_head"}
    assert parts["ideal_us"] == pytest.approx(bench.wave_ideal_ns(plan, 1, 200.0).sum() / 1e3)
    written = bench.write_trace(trace, plan, tmp_path, "trace")
    assert json.loads(written[0].read_text())["tasks"][0] == [0, 0, 1000]
    assert written[1].read_bytes()[:4] == b"\x89PNG"


def test_task_phases_per_opcode():
    plan = make_plan(replace(SMOL, n_layers=2), replace(NAMED_TARGETS["rtx3050"], workers=20), ctx=256)
    trace = fake_trace(plan, 20)
    trace["tasks"][-1][2] += 4000  # the last LM-head task takes 5 us
    phases = bench.task_phases(trace, plan)
    ops = {Op(int(o)).name for o in plan.tasks["opcode"]}
    assert set(phases) == ops
    assert phases["QKV"]["tasks"] == int(np.sum(plan.tasks["opcode"] == Op.QKV))
    assert phases["QKV"]["median_us"] == pytest.approx(1.0) and phases["QKV"]["max_us"] == pytest.approx(1.0)
    assert phases["QKV"]["start_median_us"] == pytest.approx(0.1)  # after the previous wave's last release
    assert phases["EMBED"]["start_median_us"] == pytest.approx(0.0)
    assert phases["LM_HEAD"]["max_us"] == pytest.approx(5.0) and phases["LM_HEAD"]["median_us"] == pytest.approx(1.0)


def test_device_check_phases_are_checked_before_the_gpu_run():
    module = load_script("megakernel_device_check")
    assert module.parse_phases("1,7, 9") == (1, 7, 9)
    assert module.parse_phases("") == ()
    for bad in ("1;7", "AF_TRACE_MARK=1", "10", "-1", "1 -Xptxas"):
        with pytest.raises(ParameterError, match="trace mark"):
            module.parse_phases(bad)


class CacheRuntime(ScriptedRuntime):
    """ScriptedRuntime with a K/V cache: a step or a prefill writes its position's rows from its token
    (a faulty prefill writes one value off), as the device check's prefill section reads them."""

    def __init__(self, faulty=False):
        super().__init__(ctx=1100, vocab=50, block=8)
        self.k.update(n_layers=2, n_head_kv=2, head_dim=8, head_dim_v=8)
        self.faulty = faulty
        self.cache = {name: np.zeros((2, 2, 1100, 8), np.float32) for name in ("kcache", "vcache")}
        self.buffers = {name: name for name in self.cache}
        self.device = SimpleNamespace(download=lambda name, dtype, count: self.cache[name].reshape(-1)[:count].copy())
        self.plan = SimpleNamespace(config=SMOL)

    def kv_elements(self, width):
        return self.cache["kcache"].size

    def clear_kv(self):
        for c in self.cache.values():
            c[:] = 0

    def write(self, token, pos, off=0.0):
        for c in self.cache.values():
            c[:, :, pos] = token + pos / 1000 + off

    def launch(self, tokens, pos0, n_steps=None, eos=(), all_logits=False, trace_step=None):
        result = super().launch(tokens, pos0, n_steps, eos, all_logits, trace_step)
        fed = list(tokens) + result.tokens[len(tokens) - 1:]
        for step in range(result.steps_done):
            self.write(fed[step], pos0 + step)
        return result

    def prefill(self, tokens, pos0):
        super().prefill(tokens, pos0)
        for i, t in enumerate(tokens):
            self.write(t, pos0 + i, 0.5 if self.faulty and pos0 + i == 40 else 0.0)
        return 1.0


def test_device_check_prefill_section_finds_a_prefill_unlike_decode_steps():
    module = load_script("megakernel_device_check")
    result = module.prefill_matches_decode(CacheRuntime())
    assert [r["prefilled"] for r in result["lengths"]] == [0, 8, 96, 200, 992]
    assert all(all(r["identical_bits"].values()) and r["same_tokens"] for r in result["lengths"])
    with pytest.raises(AssertionError, match="prefill differs from decode steps") as failed:
        module.prefill_matches_decode(CacheRuntime(faulty=True))
    assert '"tokens": 100' in str(failed.value) and '"k": false' in str(failed.value)
