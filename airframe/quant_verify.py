"""quant-verify: the GPU's decoding of every quant type against the `gguf` package's numpy code.

Each tensor's GGUF bytes are re-laid as the runtime lays them, decoded on the GPU by the same
`shaders/quant/<type>.wgsl` the matmul kernels include (through `shaders/dequant.wgsl`) and
compared value by value with `gguf.quants.dequantize`. Decoding is exact for every supported type,
so the verdict is exact too: a type passes when every value has the same float32 bits (two NaNs
count as equal, since WGSL does not promise NaN payloads). Big tensors are checked on sampled rows
(evenly spread, first and last included) unless `full`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from tqdm import tqdm

from .errors import ParameterError, UnsupportedError
from .gguf_file import GGUFFile, dequantize_rows
from .gpu.dequant import dequantize, upload
from .quants import SUPPORTED, quant
from .quantize import quantize

FULL_WINDOW_VALUES = 1 << 24  # values compared at a time with --full: bounds host memory
SYNTHETIC_COLS = 1024


@dataclass
class TypeResult:
    """What was checked for one quant type, and how far the GPU was from numpy."""

    qtype: str
    tensors: int = 0
    elements: int = 0
    max_abs_error: float = 0.0
    sum_abs_error: float = 0.0
    exact: int = 0  # values with identical float32 bits
    mismatches: int = 0  # values that differ (NaN against NaN excepted)
    nan_bit_differences: int = 0  # both NaN, other bits
    unsupported: str = ""  # why this type has no GPU decoder

    @property
    def mean_abs_error(self) -> float:
        return self.sum_abs_error / self.elements if self.elements else 0.0

    @property
    def exact_share(self) -> float:
        return self.exact / self.elements if self.elements else 0.0

    @property
    def ok(self) -> bool:
        return not self.unsupported and self.mismatches == 0

    def add(self, got: np.ndarray, want: np.ndarray) -> None:
        same_bits = got.view(np.uint32) == want.view(np.uint32)
        both_nan = np.isnan(got) & np.isnan(want) & ~same_bits
        with np.errstate(invalid="ignore", over="ignore"):
            error = np.abs(got.astype(np.float64) - want.astype(np.float64))
        error = np.where(same_bits | both_nan, 0.0, error)
        error[np.isnan(error)] = np.inf  # a NaN against a number
        self.elements += got.size
        self.exact += int(same_bits.sum())
        self.nan_bit_differences += int(both_nan.sum())
        self.mismatches += int(got.size - same_bits.sum() - both_nan.sum())
        self.max_abs_error = max(self.max_abs_error, float(error.max(initial=0.0)))
        self.sum_abs_error += float(error.sum())

    def as_dict(self) -> dict:
        d = asdict(self)
        del d["sum_abs_error"]
        d.update(mean_abs_error=self.mean_abs_error, exact_share=self.exact_share, ok=self.ok)
        return d


@dataclass
class Report:
    source: str  # the model file, or "synthetic"
    rows: str  # "all" or how many rows per tensor were sampled
    results: dict[str, TypeResult] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results.values())

    def result(self, qtype: GGMLQuantizationType) -> TypeResult:
        return self.results.setdefault(qtype.name, TypeResult(qtype.name))

    def as_dict(self) -> dict:
        return {"source": self.source, "rows": self.rows, "ok": self.ok,
                "types": [r.as_dict() for r in self.results.values()]}


def sample_rows(n_rows: int, n: int) -> np.ndarray:
    """`n` row indices spread evenly over the tensor, first and last included (all when n >= n_rows)."""
    if n >= n_rows:
        return np.arange(n_rows)
    return np.unique(np.linspace(0, n_rows - 1, n).round().astype(np.int64))


def check_rows(result: TypeResult, raw: np.ndarray, qtype, decoder: Path | None) -> None:
    """Decode (rows, row_bytes) on the GPU and on the CPU and add the comparison to `result`."""
    got = dequantize(upload(raw, qtype), decoder=decoder)
    result.add(got, dequantize_rows(raw, qtype))


def check_full(result: TypeResult, raw: np.ndarray, qtype, decoder: Path | None) -> None:
    """The whole tensor on the GPU (in row chunks when it is big), compared piece by piece."""
    tensor = upload(raw, qtype)
    step = max(1, FULL_WINDOW_VALUES // tensor.cols)
    for first in range(0, tensor.rows, step):
        n = min(step, tensor.rows - first)
        got = dequantize(tensor, first, n, decoder=decoder)
        result.add(got, dequantize_rows(raw[first:first + n], qtype))


def _supported(qtype: GGMLQuantizationType, result: TypeResult) -> bool:
    try:
        quant(qtype)
    except UnsupportedError as e:
        result.unsupported = str(e)
        return False
    return True


def verify_model(path: str | Path, *, rows: int = 64, full: bool = False,
                 decoder_override: dict | None = None, progress: bool = True) -> Report:
    """Every tensor of a GGUF file, grouped by quant type. `decoder_override` maps a quant type to
    a replacement decoder file (a test hook)."""
    if rows < 1:
        raise ParameterError(f"--rows {rows}: expected at least 1 row per tensor")
    gguf = GGUFFile(path)
    report = Report(str(path), "all" if full else str(rows))
    tensors = sorted(gguf.tensors.values(), key=lambda t: (t.qtype, t.name))
    for info in tqdm(tensors, desc="quant-verify", unit="tensor", disable=not progress):
        result = report.result(info.qtype)
        result.tensors += 1
        if not _supported(info.qtype, result):
            continue
        decoder = (decoder_override or {}).get(info.qtype)
        raw = gguf.raw(info.name)
        if full:
            check_full(result, raw, info.qtype, decoder)
        else:
            check_rows(result, np.ascontiguousarray(raw[sample_rows(info.n_rows, rows)]), info.qtype, decoder)
    return report


def random_bytes(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF bytes of `qtype`: every quant bit pattern, with finite, realistic f16 scales.

    F16 values keep every pattern but NaN and infinity: the GPU's f16->f32 conversion quiets
    signaling NaNs (tests/test_gpu_quant_decoders.py checks that case on its own)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    if qtype == GGMLQuantizationType.F16:
        halves = raw.view("<u2")
        halves[(halves & 0x7C00) == 0x7C00] &= np.uint16(0xBFFF)  # exponent 31 -> 15
    blocks = raw.reshape(rows, -1, size)
    for at in quant(qtype).scales:
        scales = rng.uniform(-0.02, 0.02, size=blocks.shape[:2]).astype("<f2")
        blocks[..., at:at + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return raw


def verify_synthetic(*, rows: int = 64, decoder_override: dict | None = None, progress: bool = True) -> Report:
    """Two tensors per supported type: quantized random normals, and random bytes."""
    if rows < 1:
        raise ParameterError(f"--rows {rows}: expected at least 1 row per tensor")
    rng = np.random.default_rng(0)
    report = Report("synthetic", str(rows))
    for qtype in tqdm(SUPPORTED, desc="quant-verify", unit="type", disable=not progress):
        result = report.result(qtype)
        decoder = (decoder_override or {}).get(qtype)
        values = rng.normal(0.0, 0.05, size=(rows, SYNTHETIC_COLS)).astype(np.float32)
        for raw in (quantize(values, qtype), random_bytes(qtype, rows, SYNTHETIC_COLS, rng)):
            result.tensors += 1
            check_rows(result, raw, qtype, decoder)
    return report


def format_table(report: Report) -> str:
    lines = [f"quant-verify {report.source} (rows per tensor: {report.rows})",
             f"{'type':<6} {'tensors':>7} {'elements':>13} {'max abs err':>12} {'mean abs err':>12} "
             f"{'bit-exact':>9}  result"]
    for r in report.results.values():
        if r.unsupported:
            verdict = f"FAIL: {r.unsupported}"
        elif r.ok:
            verdict = "ok"
        else:
            verdict = f"FAIL: {r.mismatches:,} values differ"
        lines.append(f"{r.qtype:<6} {r.tensors:>7} {r.elements:>13,} {r.max_abs_error:>12.3g} "
                     f"{r.mean_abs_error:>12.3g} {r.exact_share:>9.2%}  {verdict}")
    failed = [r.qtype for r in report.results.values() if not r.ok]
    lines.append("all types decode exactly" if not failed else f"FAILED: {', '.join(failed)}")
    return "\n".join(lines)
