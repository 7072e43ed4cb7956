"""Compile worker.cu at run time, for one GPU architecture, and cache the result.

nvcc when it is on PATH (or under $CUDA_HOME), NVRTC through cuda-bindings otherwise. The cache
key is the hash of worker.cu, the files it includes (plan_format.h, worker_base.cuh,
worker_ops.cuh, worker_prefill.cuh), the flags, the compiler's version and the architecture, so an edited source or
another compiler never reuses a stale binary. Each build reports what ptxas says about the
worker: registers, spills, stack frame and static shared memory.

Two build settings: the weight format `q8` (AF_Q8 in worker_base.cuh: False, the shipped build,
reads every matrix as BF16; True as Q8_0, for the packages whose plan says weights_q8), and the
diagnostic `trace_mark` (AF_TRACE_MARK: where a traced task's end stamp is taken; 0, the shipped
build, stamps the task's end).

    python -m airframe.megakernel.cuda.build --arch sm_90 [--q8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ...errors import GPUError, ParameterError
from ..plan.opcodes import HEADER_PATH

SOURCE_PATH = Path(__file__).with_name("worker.cu")
# the files worker.cu includes besides plan_format.h, in the order NVRTC is handed them
PART_PATHS = tuple(SOURCE_PATH.with_name(name) for name in ("worker_base.cuh", "worker_sample.cuh", "worker_ops.cuh",
                                                         "worker_prefill.cuh"))
KERNEL = "af_worker"
PREFILL_KERNEL = "af_prefill"
# the device functions only the prefill kernel calls (worker_prefill.cuh), by mangled name
PREFILL_CALLEE = re.compile(r"^_Z\d+pf_")
FLAGS = ("-O3", "-std=c++17")
ARCH_PATTERN = re.compile(r"^sm_\d{2,3}a?$")
TRACE_MARKS = range(10)  # AF_TRACE_MARK: 0 (the shipped build) .. 9


@dataclass(frozen=True)
class Build:
    arch: str
    compiler: str
    sha256: str  # of the cubin: what a plan's fingerprint binds to
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_static: int
    path: str  # the cached cubin
    q8: bool = False  # the weight format it reads: Q8_0 (AF_Q8) or BF16 (reports cached before it: BF16)
    prefill_registers: int = 0  # af_prefill's (reports cached before it: 0)
    prefill_spill_stores: int = 0

    @property
    def cubin(self) -> bytes:
        return Path(self.path).read_bytes()

    def summary(self) -> str:
        return (f"{KERNEL} {self.arch}{' q8' if self.q8 else ''} ({self.compiler}): {self.registers} registers, "
                f"{self.spill_stores} B spill stores, {self.spill_loads} B spill loads, "
                f"{self.stack_bytes} B stack, {self.shared_static} B static shared; {PREFILL_KERNEL}: "
                f"{self.prefill_registers} registers, {self.prefill_spill_stores} B spill stores")


def cache_dir() -> Path:
    root = os.environ.get("AIRFRAME_CACHE") or Path.home() / ".cache" / "airframe"
    return Path(root) / "megakernel"


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def check_arch(arch: str) -> str:
    if not ARCH_PATTERN.match(arch):
        raise ParameterError(f"architecture {arch!r}, expected the form sm_86 or sm_90")
    return arch


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"release [\d.]+, V([\d.]+)", out)
    return f"nvcc {match.group(1) if match else 'unknown'}"


def check_trace_mark(mark: int) -> int:
    if mark not in TRACE_MARKS:
        raise ParameterError(f"trace mark {mark!r}, expected 0..9 (AF_TRACE_MARK in worker_base.cuh)")
    return mark


def defines(trace_mark: int = 0, q8: bool = False) -> tuple[str, ...]:
    """The -D settings of a build: none for the shipped (BF16) worker."""
    return ((f"AF_TRACE_MARK={check_trace_mark(trace_mark)}",) if trace_mark else ()) + (("AF_Q8=1",) if q8 else ())


def nvcc_command(nvcc: str, arch: str, source: Path, out: Path, kind: str = "-cubin",
                 trace_mark: int = 0, q8: bool = False) -> list[str]:
    """The nvcc command line; `kind` is -cubin (what the runtime loads) or -c (an object file)."""
    return [nvcc, kind, f"-arch={check_arch(arch)}", *FLAGS, *(f"-D{d}" for d in defines(trace_mark, q8)),
            "-Xptxas", "-v", "-I", str(HEADER_PATH.parent), str(source), "-o", str(out)]


def parse_ptxas(log: str, kernel: str = KERNEL) -> dict:
    """Registers, spills, stack and static shared memory of `kernel` from a `ptxas -v` log; the
    spills of the device functions it calls (mangled names, not inlined) are added to its own:
    for af_worker every one but the prefill kernel's (PREFILL_CALLEE), for af_prefill every one."""
    start = log.find(f"Function properties for {kernel}")
    if start < 0:
        raise GPUError(f"the compiler log names no function {kernel!r}; expected a ptxas -v report")
    block = log[start:start + 600]
    numbers = {
        "stack_bytes": r"(\d+) bytes stack frame", "spill_stores": r"(\d+) bytes spill stores",
        "spill_loads": r"(\d+) bytes spill loads", "registers": r"Used (\d+) registers",
        "shared_static": r"(\d+) bytes smem",
    }
    report = {}
    for name, pattern in numbers.items():
        match = re.search(pattern, block)
        report[name] = int(match.group(1)) if match else 0
    for callee in re.finditer(r"Function properties for (_Z\w+)\s+(\d+) bytes stack frame, (\d+) bytes spill "
                              r"stores, (\d+) bytes spill loads", log):
        if kernel != PREFILL_KERNEL and PREFILL_CALLEE.match(callee.group(1)):
            continue
        report["spill_stores"] += int(callee.group(3))
        report["spill_loads"] += int(callee.group(4))
    return report


def _key(arch: str, compiler: str, trace_mark: int = 0, q8: bool = False) -> str:
    h = hashlib.sha256()
    sources = [path.read_bytes() for path in (SOURCE_PATH, HEADER_PATH, *PART_PATHS)]
    for part in (*sources, " ".join(FLAGS + defines(trace_mark, q8)).encode(), compiler.encode(), arch.encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:24]


def build_worker(arch: str, force: bool = False, trace_mark: int = 0, q8: bool = False) -> Build:
    """The compiled worker for `arch`, from the cache when the same source was built before;
    `q8` builds the one that reads Q8_0 weights, `trace_mark` > 0 the diagnostic form whose
    traces stamp a phase of a task."""
    check_arch(arch)
    check_trace_mark(trace_mark)
    nvcc = find_nvcc()
    compiler = nvcc_version(nvcc) if nvcc else _nvrtc_version()
    folder = cache_dir()
    stem = folder / f"worker-{_key(arch, compiler, trace_mark, q8)}-{arch}"
    report_path = stem.with_suffix(".json")
    if report_path.is_file() and stem.with_suffix(".cubin").is_file() and not force:
        return Build(**json.loads(report_path.read_text()))
    folder.mkdir(parents=True, exist_ok=True)
    cubin, log = _compile_nvcc(nvcc, arch, trace_mark, q8) if nvcc else _compile_nvrtc(arch, trace_mark, q8)
    stem.with_suffix(".cubin").write_bytes(cubin)
    prefill = parse_ptxas(log, PREFILL_KERNEL)
    build = Build(arch=arch, compiler=compiler, sha256=hashlib.sha256(cubin).hexdigest(),
                  path=str(stem.with_suffix(".cubin")), q8=q8, prefill_registers=prefill["registers"],
                  prefill_spill_stores=prefill["spill_stores"], **parse_ptxas(log))
    report_path.write_text(json.dumps(asdict(build), indent=1))
    return build


def _compile_nvcc(nvcc: str, arch: str, trace_mark: int = 0, q8: bool = False) -> tuple[bytes, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "worker.cubin"
        done = subprocess.run(nvcc_command(nvcc, arch, SOURCE_PATH, out, trace_mark=trace_mark, q8=q8),
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise GPUError(f"nvcc failed to compile {SOURCE_PATH.name} for {arch} "
                           f"(exit {done.returncode}):\n{done.stderr[-4000:]}")
        return out.read_bytes(), done.stdout + done.stderr


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        raise GPUError("no CUDA compiler: nvcc is not on PATH and cuda-bindings (NVRTC) is not "
                       "installed; expected one of them to build the megakernel worker") from None
    return nvrtc


def _nvrtc_version() -> str:
    nvrtc = _nvrtc()
    err, major, minor = nvrtc.nvrtcVersion()
    return f"nvrtc {major}.{minor}"


def _compile_nvrtc(arch: str, trace_mark: int = 0, q8: bool = False) -> tuple[bytes, str]:
    nvrtc = _nvrtc()
    headers = (HEADER_PATH, *PART_PATHS)
    err, prog = nvrtc.nvrtcCreateProgram(SOURCE_PATH.read_bytes(), b"worker.cu", len(headers),
                                         [h.read_bytes() for h in headers], [h.name.encode() for h in headers])
    options = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--ptxas-options=-v",
               *(f"-D{d}".encode() for d in defines(trace_mark, q8))]
    (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise GPUError(f"NVRTC failed to compile {SOURCE_PATH.name} for {arch}:\n{log.decode(errors='replace')[-4000:]}")
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * size
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    return bytes(cubin), log.decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="compile the megakernel worker and print ptxas's report")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    parser.add_argument("--q8", action="store_true", help="the worker for Q8_0 weights (AF_Q8)")
    args = parser.parse_args(argv)
    print(build_worker(args.arch, force=args.force, q8=args.q8).summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
