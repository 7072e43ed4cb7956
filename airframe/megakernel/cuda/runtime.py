"""Run a megakernel package on an NVIDIA GPU: the driver, the loaded worker, the uploaded package.

Everything goes through the CUDA driver API of `cuda-bindings` (present wherever the CUDA
toolkit's Python packages are; not a dependency of airframe). A launch is cooperative: the plan's
workers are the grid, one 1024-thread block per SM, and all of them are resident at once, which
the grid barrier between waves needs. One launch runs up to 64 tokens (`MAX_STEPS`); greedy
selection and the end-of-generation test happen inside the kernel. A prompt's tokens but its last
go through the prefill kernel (`Runtime.prefill`), BLOCK tokens a step, where it fits.

Before the first launch the runtime refuses a package that was made for another worker binary,
another architecture, more workers than this GPU holds, or that fails the plan validator; and it
checks its picture of the kernel's argument struct against the compiled one (`af_layout`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from tqdm import tqdm

from ...errors import GPUError, NonFiniteError, UnsupportedError
from ..plan.opcodes import PLAN_CONSTS, TASK_WORDS, Op
from ..plan.package import Package
from ..plan.validator import PlanError
from .build import Build, build_worker
from .sampling import SAMPLE_K, SAMPLING_DTYPE, DrawSettings, sample_floats

# constants of worker_base.cuh (af_layout reports the first and the last to the host)
THREADS = 1024  # AF_THREADS
MAX_STEPS = 64  # AF_MAX_STEPS
MAX_EOS = 8  # AF_MAX_EOS
MAX_GROUP = 8  # AF_MAX_GROUP
XS_PLANE_FLOATS = 2048  # AF_XS_PLANE_FLOATS: xs holds vectors of up to twice this
FFN_COPIES = 2  # AF_FFN_COPIES
BLOCK = 8  # AF_BLOCK: the tokens of a prefill step
UPLOAD_BLOCK = 256 << 20

_NUMPY = {"u32": "<u4", "u64": "<u8", "f32": "<f4"}
CONSTS_DTYPE = np.dtype([(name, _NUMPY[kind]) for name, kind, _ in PLAN_CONSTS], align=True)
_POINTERS = ("tasks", "cells", "weights", "act", "kcache", "vcache", "ctl", "barrier",
             "logits_all", "trace", "trace_waves", "samp")
ARGS_DTYPE = np.dtype([("c", CONSTS_DTYPE), *[(p, "<u8") for p in _POINTERS],
                       ("ffn_max_rows", "<u4"), ("shared_floats", "<u4"), ("table_offset", "<u4"),
                       ("table_tasks", "<u4"), ("sides", "<u4")], align=True)

# af_control as 32-bit words: inputs, then outputs
CONTROL_FIELDS = {"n_steps": 0, "pos0": 1, "n_forced": 2, "n_eos": 3, "eos": 4, "trace_step": 12, "hold_pos": 13,
                  "tokens_in": 16, "steps_done": 80, "error": 81, "stopped": 82, "error_step": 83, "tokens_out": 84}
CONTROL_WORDS = 84 + MAX_STEPS
ERROR_NON_FINITE = 1
ERROR_FFN_RANGE = 2  # op_ffn: an FFN partial not finite or |v| >= 2^22 (its fixed-point sum's range)


def check_error_word(ctl: np.ndarray, pos0: int, hold_pos: bool = False) -> None:
    """NonFiniteError naming the position where the worker met a NaN or infinite logit, or an FFN
    output that is not finite or too large for its fixed-point sum (the error word of af_control)."""
    f = CONTROL_FIELDS
    error = int(ctl[f["error"]])
    if not error & (ERROR_NON_FINITE | ERROR_FFN_RANGE):
        return
    step = int(ctl[f["error_step"]])
    what = ("an FFN output that is not finite or reaches 2^22 in magnitude (the range of its fixed-point "
            "sum)" if error & ERROR_FFN_RANGE else "a non-finite logit")
    raise NonFiniteError(f"{what} at position {pos0 + (0 if hold_pos else step)} (step {step} of the launch); "
                         "expected finite logits: the weights or activations hold NaN or inf")


# ---- the driver ---------------------------------------------------------------------------------
def driver():
    """cuda.bindings.driver, or GPUError saying why there is no CUDA here."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        raise GPUError("no CUDA: the cuda backend needs an NVIDIA GPU, its driver and the "
                       "cuda-bindings package (pip install cuda-bindings); found no cuda-bindings") from None
    return cu


def check(result, what: str):
    """Unpack a cuda-bindings result tuple; raise GPUError naming the call and the CUDA error."""
    cu = driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise GPUError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@dataclass
class DeviceBuffer:
    ptr: int
    size: int


class Device:
    """One CUDA device with its primary context made current."""

    def __init__(self, ordinal: int = 0):
        cu = driver()
        try:
            err = cu.cuInit(0)
        except Exception as e:  # the bindings raise when libcuda itself is missing
            raise GPUError(f"no CUDA GPU: the NVIDIA driver library could not be loaded ({e})") from None
        err = err[0] if isinstance(err, tuple) else err
        if err != cu.CUresult.CUDA_SUCCESS:
            raise GPUError(f"no CUDA GPU: cuInit returned {cu.cuGetErrorName(err)[1]}, expected a working NVIDIA driver")
        count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if count <= ordinal:
            raise GPUError(f"CUDA device {ordinal} asked for, found {count} CUDA devices")
        self.cu = cu
        self.handle = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self.name = check(cu.cuDeviceGetName(100, self.handle), "cuDeviceGetName").split(b"\0")[0].decode()
        major = self._attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR")
        minor = self._attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")
        self.arch = f"sm_{major}{minor}"
        self.sm_count = self._attribute("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")
        self.shared_optin = self._attribute("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")
        self.cooperative = self._attribute("CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH")

    def make_current(self) -> None:
        """Make the context current on the calling thread, as a CUDA context is current per thread
        (the server loads on one thread and runs requests on another)."""
        check(self.cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def _attribute(self, name: str) -> int:
        attr = getattr(self.cu.CUdevice_attribute, name)
        return check(self.cu.cuDeviceGetAttribute(attr, self.handle), name)

    def alloc(self, size: int, zero: bool = True) -> DeviceBuffer:
        ptr = int(check(self.cu.cuMemAlloc(max(size, 16)), f"cuMemAlloc({size} bytes)"))
        if zero:
            check(self.cu.cuMemsetD8(ptr, 0, max(size, 16)), "cuMemsetD8")
        return DeviceBuffer(ptr, size)

    def free(self, buf: DeviceBuffer | None) -> None:
        if buf is not None:
            check(self.cu.cuMemFree(buf.ptr), "cuMemFree")

    def upload(self, buf: DeviceBuffer, array: np.ndarray, offset: int = 0) -> None:
        array = np.ascontiguousarray(array)
        if offset + array.nbytes > buf.size:
            raise GPUError(f"upload of {array.nbytes} bytes at {offset} into a buffer of {buf.size}")
        check(self.cu.cuMemcpyHtoD(buf.ptr + offset, array.ctypes.data, array.nbytes), "cuMemcpyHtoD")

    def download(self, buf: DeviceBuffer, dtype, count: int, offset: int = 0) -> np.ndarray:
        out = np.empty(count, dtype=dtype)
        if offset + out.nbytes > buf.size:
            raise GPUError(f"download of {out.nbytes} bytes at {offset} from a buffer of {buf.size}")
        check(self.cu.cuMemcpyDtoH(out.ctypes.data, buf.ptr + offset, out.nbytes), "cuMemcpyDtoH")
        return out

    def synchronize(self, what: str = "the worker") -> None:
        check(self.cu.cuCtxSynchronize(), f"running {what}")


# ---- the compiled worker ------------------------------------------------------------------------
class Worker:
    """The worker module loaded on a device: its kernels and their resource use."""

    def __init__(self, device: Device, build: Build | None = None):
        self.device = device
        self.build = build or build_worker(device.arch)
        if self.build.arch != device.arch:
            raise GPUError(f"worker built for {self.build.arch}, this GPU is {device.arch}")
        cu = device.cu
        self._image = self.build.cubin
        self.module = check(cu.cuModuleLoadData(self._image), "cuModuleLoadData(worker)")
        self.kernel = check(cu.cuModuleGetFunction(self.module, b"af_worker"), "af_worker")
        self.layout_kernel = check(cu.cuModuleGetFunction(self.module, b"af_layout"), "af_layout")
        self.stream_kernel = check(cu.cuModuleGetFunction(self.module, b"af_stream_read"), "af_stream_read")
        self.prefill_kernel = check(cu.cuModuleGetFunction(self.module, b"af_prefill"), "af_prefill")
        attr = cu.CUfunction_attribute
        self.registers = check(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, self.kernel), "NUM_REGS")
        self.local_bytes = check(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, self.kernel), "LOCAL_SIZE")
        self.static_shared = check(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self.kernel),
                                   "SHARED_SIZE")
        self.check_layout()

    def set_shared(self, nbytes: int, kernel=None) -> None:
        attr = self.device.cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(self.device.cu.cuFuncSetAttribute(kernel or self.kernel, attr, nbytes), f"dynamic shared memory {nbytes} B")

    def blocks_per_sm(self, shared_bytes: int, kernel=None) -> int:
        self.set_shared(shared_bytes, kernel)
        return check(self.device.cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel or self.kernel, self.threads,
                                                                               shared_bytes), "occupancy")

    def launch(self, kernel, grid: int, block: int, shared: int, args: Sequence[np.ndarray], cooperative: bool) -> None:
        """args: one numpy array per kernel parameter, holding its bytes."""
        pointers = np.array([a.ctypes.data for a in args], dtype=np.uint64)
        cu = self.device.cu
        if cooperative:
            result = cu.cuLaunchCooperativeKernel(kernel, grid, 1, 1, block, 1, 1, shared, 0, pointers.ctypes.data)
        else:
            result = cu.cuLaunchKernel(kernel, grid, 1, 1, block, 1, 1, shared, 0, pointers.ctypes.data, 0)
        check(result, "kernel launch")

    def check_layout(self) -> None:
        """The compiled sizes and offsets of af_args and af_control against the host's."""
        dev = self.device
        out = dev.alloc(64)
        try:
            self.launch(self.layout_kernel, 1, 1, 0, [np.array([out.ptr], dtype=np.uint64)], cooperative=False)
            dev.synchronize("af_layout")
            found = dev.download(out, np.uint32, 12).tolist()
        finally:
            dev.free(out)
        expected = [ARGS_DTYPE.itemsize, CONSTS_DTYPE.itemsize, ARGS_DTYPE.fields["tasks"][1],
                    ARGS_DTYPE.fields["ffn_max_rows"][1], CONSTS_DTYPE.fields["rope_cos"][1],
                    4 * CONTROL_WORDS, 4 * CONTROL_FIELDS["steps_done"], THREADS, FFN_COPIES,
                    SAMPLING_DTYPE.itemsize, SAMPLING_DTYPE.fields["u"][1], BLOCK]
        if found != expected:
            raise GPUError(f"worker argument layout {found}, expected {expected} (sizeof args, consts, offsets "
                           "of tasks, ffn_max_rows, rope_cos, control, outputs, threads, FFN copies, sizeof "
                           "af_sampling, its offset of u, prefill block)")
        self.threads = THREADS

    def stream_read_gbs(self, nbytes: int = 4 << 30, repeats: int = 10) -> float:
        """Streaming-read bandwidth in GB/s: the median of `repeats` reads of `nbytes`."""
        dev, cu = self.device, self.device.cu
        buf = dev.alloc(nbytes, zero=False)
        check(cu.cuMemsetD32(buf.ptr, 0x3F803F80, nbytes // 4), "cuMemsetD32")
        sink = dev.alloc(16)
        args = [np.array([buf.ptr], np.uint64), np.array([nbytes // 16], np.uint64), np.array([sink.ptr], np.uint64)]
        grid = dev.sm_count * 8
        try:
            times = []
            for i in range(repeats + 2):
                ms = self.timed(lambda: self.launch(self.stream_kernel, grid, 256, 0, args, cooperative=False))
                if i >= 2:
                    times.append(ms)
        finally:
            dev.free(buf)
            dev.free(sink)
        return nbytes / (float(np.median(times)) * 1e-3) / 1e9

    def timed(self, work, timeout_s: float = 60.0) -> float:
        """Milliseconds of GPU time around `work()`, by CUDA events; GPUError after `timeout_s`."""
        cu = self.device.cu
        start = check(cu.cuEventCreate(0), "cuEventCreate")
        end = check(cu.cuEventCreate(0), "cuEventCreate")
        try:
            check(cu.cuEventRecord(start, 0), "cuEventRecord")
            work()
            check(cu.cuEventRecord(end, 0), "cuEventRecord")
            self.wait(end, timeout_s)
            return float(check(cu.cuEventElapsedTime(start, end), "cuEventElapsedTime"))
        finally:
            cu.cuEventDestroy(start)
            cu.cuEventDestroy(end)

    def wait(self, event, timeout_s: float) -> None:
        """Poll `event` until the GPU reaches it: a worker stuck at a barrier becomes an error."""
        cu = self.device.cu
        deadline = time.monotonic() + timeout_s
        while True:
            (err,) = cu.cuEventQuery(event)
            if err == cu.CUresult.CUDA_SUCCESS:
                return
            if err != cu.CUresult.CUDA_ERROR_NOT_READY:
                check((err,), "running the worker")
            if time.monotonic() > deadline:
                raise GPUError(f"the worker did not finish within {timeout_s:.0f} s, expected far less: "
                               "a block is stuck (the GPU must be released by ending this process)")
            time.sleep(0.0002)


# ---- a package on the device --------------------------------------------------------------------
@dataclass
class LaunchResult:
    steps_done: int
    tokens: list[int]  # greedy token after each step done
    stopped: bool  # an end-of-generation token ended the launch
    ms: float = 0.0  # GPU time of the launch (CUDA events)
    trace: dict | None = None


def check_model_limits(k: dict) -> None:
    """What worker.cu assumes about the shape; UnsupportedError naming the value otherwise."""
    g = k["n_head"] // max(1, k["n_head_kv"])
    lanes = k["head_dim"] // 8
    problems = []
    for name in ("n_embd",):
        if k[name] % 8:
            problems.append(f"{name} = {k[name]} is not a multiple of 8")
    if (k["n_head"] * k["head_dim_v"]) % 8:
        problems.append(f"n_head * head_dim_v = {k['n_head'] * k['head_dim_v']} is not a multiple of 8")
    if k["head_dim"] % 8 or lanes < 1 or lanes > 32 or lanes & (lanes - 1):
        problems.append(f"head_dim = {k['head_dim']}, expected 8 times a power of two up to 256")
    if g > MAX_GROUP or (g + 1) * k["head_dim"] + k["head_dim_v"] > THREADS:
        problems.append(f"{g} query heads per K/V head of {k['head_dim']}, expected at most {MAX_GROUP} "
                        f"and (group + 1) * head_dim + head_dim_v <= {THREADS}")
    x_len = max(k["n_embd"], k["n_head"] * k["head_dim_v"])
    if x_len > 2 * XS_PLANE_FLOATS:
        problems.append(f"vectors of {x_len} (n_embd, n_head * head_dim_v), expected at most {2 * XS_PLANE_FLOATS}")
    if k["head_dim_v"] > THREADS:
        problems.append(f"head_dim_v = {k['head_dim_v']}, expected at most {THREADS}")
    # the FFN sums' 64-bit accumulators fill two slots a copy; 512 * 2^22 * 2^32 < 2^63
    if not 2 * FFN_COPIES <= k["ffn_parts"] <= 512:
        problems.append(f"ffn_parts = {k['ffn_parts']}, expected {2 * FFN_COPIES}..512 (the FFN sums' "
                        f"{FFN_COPIES} copies fill {2 * FFN_COPIES} slots; at most 512 partials)")
    if problems:
        raise UnsupportedError("the CUDA worker cannot run this plan: " + "; ".join(problems))


def shared_floats(k: dict, ffn_max_rows: int, stage: bool = False) -> int:
    """Dynamic shared memory of the worker in floats before its task table; af_worker's layout.
    stage: room for every attention chunk's records, staged for the WO merge (merge_staged)."""
    x_len = 2 * XS_PLANE_FLOATS  # xs: two planes
    cols = k["n_embd"] // 8
    ffn_groups = 1 if cols >= THREADS else THREADS // cols
    g = k["n_head"] // k["n_head_kv"]
    v_groups = THREADS // k["head_dim_v"]
    attn = (g * k["head_dim"] + k["head_dim"] + k["head_dim_v"] + g * k["attn_chunk"]
            + v_groups * g * k["head_dim_v"] + 2 * g)  # q, k and v at pos, scores, value groups, m and l
    ffn = 2 * ffn_max_rows + ffn_groups * k["n_embd"]
    chunks, heads = k["attn_chunks"], k["n_head"]
    staged = -(-chunks * heads * (k["head_dim_v"] + 2) // 4) * 4 + heads * (chunks + 2) if stage else 0
    return -(-(x_len + 64 + max(attn, ffn, staged, 2 * (THREADS // 32))) // 4) * 4


def prefill_shared_floats(k: dict, ffn_max_rows: int, stage: bool = False) -> int:
    """Dynamic shared memory of the prefill kernel in floats before its task table; af_prefill's
    layout (worker_prefill.cuh): xs and red of each of the block's tokens, then the opcodes' scratch
    (pf_ffn: the block's gate, up and silu(gate) * up rows)."""
    g = k["n_head"] // k["n_head_kv"]
    v_groups = THREADS // k["head_dim_v"]
    attn = (g * k["head_dim"] + BLOCK * (k["head_dim"] + k["head_dim_v"]) + g * k["attn_chunk"]
            + v_groups * g * k["head_dim_v"] + 2 * g)  # q, the block's K and V, scores, value groups, m and l
    ffn = 3 * BLOCK * ffn_max_rows
    chunks, heads = k["attn_chunks"], k["n_head"]
    staged = -(-chunks * heads * (k["head_dim_v"] + 2) // 4) * 4 + heads * (chunks + 2) if stage else 0
    return -(-(BLOCK * (2 * XS_PLANE_FLOATS + 64) + max(attn, ffn, staged, 2 * (THREADS // 32))) // 4) * 4


def side_bits(tasks: np.ndarray) -> int:
    """af_args.sides: bit 0 when some QKV task writes the qkv_side vector, bit 1 when some WO task
    writes h_side. A side vector no task writes stays zero, and the worker skips reading it."""
    side = tasks["side"] != 0
    return int(np.any(side & (tasks["opcode"] == int(Op.QKV)))) | 2 * int(np.any(side & (tasks["opcode"] == int(Op.WO))))


def table_floats(tasks: np.ndarray, n_waves: int, workers: int) -> tuple[int, int]:
    """(floats, most tasks of one worker) of the per-block task table in shared memory."""
    most = int(np.bincount(tasks["worker"], minlength=workers).max())
    return -(-(2 * n_waves + 1) // 4) * 4 + most * TASK_WORDS, most


def task_cells(tasks: np.ndarray, n_waves: int, workers: int) -> np.ndarray:
    """cells[w * workers + k]: the first task of (wave w, worker k); tasks sorted by (wave, worker)."""
    keys = tasks["wave"].astype(np.int64) * workers + tasks["worker"].astype(np.int64)
    if np.any(np.diff(keys) < 0):
        raise PlanError("tasks.bin is not sorted by (wave, worker), expected that order")
    return np.searchsorted(keys, np.arange(n_waves * workers + 1)).astype(np.uint32)


class Runtime:
    """A validated package uploaded to one device, ready to launch."""

    def __init__(self, package: Package, worker: Worker, progress: bool = True):
        self.package, self.worker, self.device = package, worker, worker.device
        self.plan, self.k = package.plan, package.plan.consts
        self.check_target()
        check_model_limits(self.k)
        self.workers = self.plan.target.workers
        ffn = self.plan.tasks[self.plan.tasks["opcode"] == 5]
        self.ffn_max_rows = int(ffn["row_count"].max()) if len(ffn) else 0
        table, self.table_tasks = table_floats(self.plan.tasks, self.k["n_waves"], self.plan.target.workers)
        # room for the staged attention merge where the GPU has it (the worker checks it and
        # merges four chunks at a time without)
        self.staged = (4 * (shared_floats(self.k, self.ffn_max_rows, True) + table)
                       + worker.static_shared <= self.device.shared_optin)
        self.table_offset = shared_floats(self.k, self.ffn_max_rows, self.staged)
        self.shared_floats = self.table_offset + table
        self.shared_bytes = 4 * self.shared_floats
        if self.shared_bytes + worker.static_shared > self.device.shared_optin:
            raise UnsupportedError(f"the worker needs {self.shared_bytes} B of shared memory for this plan, "
                                   f"this GPU allows {self.device.shared_optin} B per block")
        # a launch that draws sampled tokens holds their keys in shared memory after sm: its task
        # table starts further on (None: this GPU has no room for them)
        lm = self.plan.tasks[self.plan.tasks["opcode"] == int(Op.LM_HEAD)]
        self.lm_rows = (int(lm["row_count"].min()), int(lm["row_count"].max()))
        offset = max(self.table_offset, -(-(2 * XS_PLANE_FLOATS + 64 + sample_floats(self.k["lm_parts"],
                                                                                        self.lm_rows[1])) // 4) * 4)
        fits = 4 * (offset + table) + worker.static_shared <= self.device.shared_optin
        self.sampled_layout = (offset, offset + table) if fits else None
        per_sm = worker.blocks_per_sm(self.shared_bytes)
        if self.workers > per_sm * self.device.sm_count:
            raise PlanError(f"plan for {self.workers} workers, this GPU holds {per_sm * self.device.sm_count} "
                            f"resident blocks of {worker.threads} threads ({self.device.sm_count} SMs x {per_sm})")
        self.prefill_layout(table)
        self.buffers: dict[str, DeviceBuffer] = {}
        self._upload(progress)

    def prefill_layout(self, table: int) -> None:
        """Whether prompts take the prefill kernel here (self.block = BLOCK; 0: token by token), and
        its shared memory: its xs for BLOCK tokens must fit beside the table, with the staged
        merge's room where the GPU has it, and every worker must stay resident."""
        optin, static = self.device.shared_optin, self.worker.static_shared
        staged = 4 * (prefill_shared_floats(self.k, self.ffn_max_rows, True) + table) + static <= optin
        self.prefill_table_offset = prefill_shared_floats(self.k, self.ffn_max_rows, staged)
        self.prefill_shared_bytes = 4 * (self.prefill_table_offset + table)
        fits = self.prefill_shared_bytes + static <= optin
        resident = fits and self.worker.blocks_per_sm(self.prefill_shared_bytes, self.worker.prefill_kernel) \
            * self.device.sm_count >= self.workers
        # pf_down keeps a column's FFN row groups in one warp: n_embd / 8 >= 32 columns
        self.block = BLOCK if resident and self.k["n_embd"] >= 256 else 0

    def check_target(self) -> None:
        target, build = self.plan.target, self.worker.build
        if bool(self.k["weights_q8"]) != build.q8:
            held, runs = ("Q8_0", "BF16") if self.k["weights_q8"] else ("BF16", "Q8_0")
            raise PlanError(f"package holds {held} matrices, this worker is built for {runs} ones (AF_Q8): "
                            f"build the worker with q8={bool(self.k['weights_q8'])}")
        if target.binary_sha256 != build.sha256:
            raise PlanError(f"package made for worker binary {target.binary_sha256}, this GPU runs "
                            f"{build.sha256} ({build.arch}, {build.compiler}): plan it again for this worker")
        if target.arch != self.device.arch:
            raise PlanError(f"package made for {target.arch}, this GPU is {self.device.arch}")
        if target.threads_per_worker != self.worker.threads:
            raise PlanError(f"package made for {target.threads_per_worker} threads per worker, "
                            f"the worker has {self.worker.threads}")

    # ---- memory ---------------------------------------------------------------------------------
    def _upload(self, progress: bool) -> None:
        dev, k = self.device, self.k
        weights = self.package.weights
        b = self.buffers
        b["weights"] = dev.alloc(weights.nbytes, zero=False)
        with tqdm(total=weights.nbytes, unit="B", unit_scale=True, desc="uploading weights",
                  disable=not progress, leave=False) as bar:
            for start in range(0, weights.nbytes, UPLOAD_BLOCK):
                block = np.asarray(weights[start:start + UPLOAD_BLOCK])
                dev.upload(b["weights"], block, start)
                bar.update(block.nbytes)
        b["tasks"] = dev.alloc(self.plan.tasks.nbytes)
        dev.upload(b["tasks"], self.plan.tasks)
        cells = task_cells(self.plan.tasks, k["n_waves"], self.workers)
        b["cells"] = dev.alloc(cells.nbytes)
        dev.upload(b["cells"], cells)
        b["act"] = dev.alloc(4 * k["act_size"] * max(1, self.block))  # an arena per token of a prefill step
        b["kcache"] = dev.alloc(4 * self.kv_elements("head_dim"))
        b["vcache"] = dev.alloc(4 * self.kv_elements("head_dim_v"))
        b["ctl"] = dev.alloc(4 * CONTROL_WORDS)
        b["barrier"] = dev.alloc(16)
        b["logits_all"] = dev.alloc(4 * MAX_STEPS * k["vocab"])

    def _sampling_buffers(self) -> dict:
        if "samp" not in self.buffers:
            dev, k = self.device, self.k
            self.buffers["samp"] = dev.alloc(SAMPLING_DTYPE.itemsize)
            self.buffers["samp_bias"] = dev.alloc(8 * k["vocab"])
            self.buffers["samp_win"] = dev.alloc(2 * 4 * k["vocab"])
            self.buffers["samp_gen"] = dev.alloc(2 * 4 * k["vocab"])
            self.buffers["samp_hist"] = dev.alloc(4 * (k["ctx"] + MAX_STEPS))
            self.buffers["samp_cand"] = dev.alloc(16 * SAMPLE_K * k["lm_parts"])
        return self.buffers

    def draw_refuses(self, top_k: int) -> str | None:
        """Why a launch of this package cannot draw with top_k candidates (None: it can)."""
        if self.sampled_layout is None:
            return "this GPU has no room in shared memory for the candidates' keys"
        if top_k > self.lm_rows[0]:
            return f"top_k = {top_k} is more than an LM_HEAD task's {self.lm_rows[0]} rows"
        return None

    def _upload_sampling(self, draw: DrawSettings) -> int:
        """The settings and state of a drawing launch on the device; the address of af_sampling."""
        b, dev = self._sampling_buffers(), self.device
        h = draw.header.copy()
        for name, buf in (("bias", "samp_bias"), ("win", "samp_win"), ("gen", "samp_gen"), ("hist", "samp_hist"),
                          ("cand", "samp_cand")):
            h[name] = b[buf].ptr
        dev.upload(b["samp"], h)
        if draw.bias is not None:
            dev.upload(b["samp_bias"], draw.bias.astype(np.float64))
        # both states start as the first drawing step's (worker_sample.cuh, advance_state)
        dev.upload(b["samp_win"], np.concatenate([draw.win, draw.win]))
        dev.upload(b["samp_gen"], np.concatenate([draw.gen, draw.gen]))
        dev.upload(b["samp_hist"], draw.hist)
        return b["samp"].ptr

    def kv_elements(self, width: str) -> int:
        k = self.k
        return k["n_layers"] * k["n_head_kv"] * k["ctx"] * k[width]

    def close(self) -> None:
        for buf in self.buffers.values():
            self.device.free(buf)
        self.buffers.clear()

    def set_kv(self, kcache: np.ndarray, vcache: np.ndarray) -> None:
        """Overwrite the whole K/V cache, (layer, kv head, ctx, head_dim) F32 each."""
        self.device.upload(self.buffers["kcache"], kcache.astype(np.float32))
        self.device.upload(self.buffers["vcache"], vcache.astype(np.float32))

    def clear_kv(self) -> None:
        for name in ("kcache", "vcache"):
            check(self.device.cu.cuMemsetD8(self.buffers[name].ptr, 0, self.buffers[name].size), "cuMemsetD8")

    def poke_weights(self, offset: int, data: bytes) -> None:
        """Overwrite bytes of the uploaded weights (tests plant non-finite values this way)."""
        self.device.upload(self.buffers["weights"], np.frombuffer(data, dtype=np.uint8), offset)

    def logits(self) -> np.ndarray:
        self.device.make_current()
        return self.device.download(self.buffers["act"], np.float32, self.k["vocab"], 4 * self.k["act_logits"])

    def all_logits(self, steps: int) -> np.ndarray:
        self.device.make_current()
        out = self.device.download(self.buffers["logits_all"], np.float32, steps * self.k["vocab"])
        return out.reshape(steps, self.k["vocab"])

    # ---- launching ------------------------------------------------------------------------------
    def args(self, all_logits: bool, trace: dict | None, samp: int = 0) -> np.ndarray:
        a = np.zeros(1, dtype=ARGS_DTYPE)
        for name in CONSTS_DTYPE.names:
            a["c"][name] = self.k[name]
        for name in ("tasks", "cells", "weights", "act", "kcache", "vcache", "ctl", "barrier"):
            a[name] = self.buffers[name].ptr
        a["logits_all"] = self.buffers["logits_all"].ptr if all_logits else 0
        if trace:
            a["trace"], a["trace_waves"] = trace["tasks"].ptr, trace["waves"].ptr
        a["ffn_max_rows"] = self.ffn_max_rows
        a["shared_floats"] = self.shared_floats
        a["table_offset"], a["table_tasks"] = self.table_offset, self.table_tasks
        a["samp"] = samp
        if samp:
            a["table_offset"], a["shared_floats"] = self.sampled_layout
        a["sides"] = side_bits(self.plan.tasks)
        return a

    def control(self, tokens: Sequence[int], pos0: int, n_steps: int, eos: Sequence[int], trace_step: int,
                hold_pos: bool = False) -> np.ndarray:
        ctl = np.zeros(CONTROL_WORDS, dtype=np.uint32)
        f = CONTROL_FIELDS
        ctl[f["n_steps"]], ctl[f["pos0"]], ctl[f["n_forced"]] = n_steps, pos0, len(tokens)
        ctl[f["n_eos"]] = len(eos)
        ctl[f["eos"]:f["eos"] + len(eos)] = eos
        ctl[f["trace_step"]] = trace_step
        ctl[f["hold_pos"]] = int(hold_pos)
        ctl[f["tokens_in"]:f["tokens_in"] + len(tokens)] = tokens
        return ctl

    def launch(self, tokens: Sequence[int], pos0: int, n_steps: int | None = None, eos: Sequence[int] = (),
               all_logits: bool = False, trace_step: int | None = None, hold_pos: bool = False,
               draw: DrawSettings | None = None) -> LaunchResult:
        """Run steps at positions pos0..: the first len(tokens) take `tokens`, later ones the token
        the step before chose: the greedy one, or with `draw` the one it drew (draw_refuses says
        where it may). With `hold_pos` every step runs at pos0, writing its K/V there (benchmarks:
        the cost of a token at one context). Raises NonFiniteError when a logit was not finite."""
        self.device.make_current()
        k = self.k
        n_steps = len(tokens) if n_steps is None else n_steps
        if not 1 <= n_steps <= MAX_STEPS or len(tokens) > n_steps or not tokens:
            raise GPUError(f"{n_steps} steps with {len(tokens)} given tokens, expected 1..{MAX_STEPS} steps "
                           "and at least one token")
        last = pos0 if hold_pos else pos0 + n_steps - 1
        if pos0 < 0 or last >= k["ctx"]:
            raise GPUError(f"positions {pos0}..{last}, the package holds {k['ctx']}")
        if len(eos) > MAX_EOS:
            eos = list(eos)[:MAX_EOS]
        self._check_vocab(tokens)
        trace = self._trace_buffers() if trace_step is not None else None
        dev = self.device
        dev.upload(self.buffers["ctl"], self.control(tokens, pos0, n_steps, eos, trace_step or 0, hold_pos))
        check(dev.cu.cuMemsetD32(self.buffers["barrier"].ptr, 0, 4), "cuMemsetD32")
        if draw is not None and (why := self.draw_refuses(draw.top_k)):
            raise GPUError(f"a launch that draws its tokens: {why}")
        samp = self._upload_sampling(draw) if draw is not None else 0
        args = self.args(all_logits, trace, samp)
        shared = 4 * int(args["shared_floats"][0])
        # the kernel's dynamic shared-memory limit is per function: another Runtime on the same
        # worker (another plan) may have set it lower since this one was made
        self.worker.set_shared(shared)

        def go():
            self.worker.launch(self.worker.kernel, self.workers, self.worker.threads, shared, [args], cooperative=True)

        ms = self.worker.timed(go)
        ctl = dev.download(self.buffers["ctl"], np.uint32, CONTROL_WORDS)
        f = CONTROL_FIELDS
        done = int(ctl[f["steps_done"]])
        check_error_word(ctl, pos0, hold_pos)
        result = LaunchResult(done, [int(t) for t in ctl[f["tokens_out"]:f["tokens_out"] + done]],
                              bool(ctl[f["stopped"]]), ms)
        if trace:
            result.trace = self._read_trace(trace)
        return result

    def _check_vocab(self, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= int(t) < self.k["vocab"]]
        if bad:
            raise GPUError(f"token {bad[0]}, expected 0..{self.k['vocab'] - 1}")

    def prefill(self, tokens: Sequence[int], pos0: int, trace_step: int | None = None) -> float:
        """Run `tokens`, a multiple of self.block, at positions pos0.. through the prefill kernel,
        MAX_STEPS tokens a launch: their K and V rows reach the cache with the bits decode steps
        would have written there, and no logits are made. Returns the launches' GPU ms. With
        `trace_step`, that step of the first launch is traced into self.prefill_trace."""
        self.device.make_current()
        if not self.block:
            raise GPUError("this GPU has no room for the prefill kernel's shared memory; expected prompts token "
                           "by token (Runtime.launch)")
        if not tokens or len(tokens) % self.block:
            raise GPUError(f"a prefill of {len(tokens)} tokens, expected a positive multiple of {self.block}")
        if pos0 < 0 or pos0 + len(tokens) > self.k["ctx"]:
            raise GPUError(f"positions {pos0}..{pos0 + len(tokens) - 1}, the package holds {self.k['ctx']}")
        self._check_vocab(tokens)
        dev, f = self.device, CONTROL_FIELDS
        trace = self._trace_buffers() if trace_step is not None else None
        self.worker.set_shared(self.prefill_shared_bytes, self.worker.prefill_kernel)
        ms = 0.0
        for start in range(0, len(tokens), MAX_STEPS):
            chunk = list(tokens[start:start + MAX_STEPS])
            steps = len(chunk) // self.block
            args = self.args(False, trace if start == 0 else None)
            args["table_offset"], args["shared_floats"] = self.prefill_table_offset, self.prefill_shared_bytes // 4
            dev.upload(self.buffers["ctl"], self.control(chunk, pos0 + start, steps, (), trace_step or 0))
            check(dev.cu.cuMemsetD32(self.buffers["barrier"].ptr, 0, 4), "cuMemsetD32")
            ms += self.worker.timed(lambda: self.worker.launch(
                self.worker.prefill_kernel, self.workers, self.worker.threads, self.prefill_shared_bytes, [args],
                cooperative=True))
            ctl = dev.download(self.buffers["ctl"], np.uint32, CONTROL_WORDS)
            check_error_word(ctl, pos0 + start)
            if int(ctl[f["steps_done"]]) != steps:
                raise GPUError(f"the prefill kernel ran {int(ctl[f['steps_done']])} steps, expected {steps}")
            if trace and start == 0:
                self.prefill_trace = self._read_trace(trace)
        return ms

    def _trace_buffers(self) -> dict:
        if "trace_tasks" not in self.buffers:
            self.buffers["trace_tasks"] = self.device.alloc(16 * self.k["n_tasks"])
            self.buffers["trace_waves"] = self.device.alloc(8 * self.k["n_waves"] * self.workers)
        return {"tasks": self.buffers["trace_tasks"], "waves": self.buffers["trace_waves"]}

    def _read_trace(self, trace: dict) -> dict:
        tasks = self.device.download(trace["tasks"], np.uint64, 2 * self.k["n_tasks"]).reshape(-1, 2)
        waves = self.device.download(trace["waves"], np.uint64, self.k["n_waves"] * self.workers)
        return {"tasks": tasks, "waves": waves.reshape(self.k["n_waves"], self.workers)}
