"""What one step of a megakernel chain costs on this GPU, with one 1024-thread block per SM as the
worker runs (cooperative launch, the worker's grid barrier). Seven parts:

- barrier: a grid barrier from a block's arrival to its release; vectors: the read of one float
  that another block wrote just before the barrier, and of 8 or 32 KiB read by every block, from
  the same lines or from 2-132 copies (does a hot line queue its readers?);
- pages: the read of a fresh float after every block has touched 8-1024 other 2 MiB pages (does
  address translation cost?), with the float written by a warp or by one lane of each warp;
- icache: 256 dependent FMAs in every thread, from one body of code or walking 2-48 bodies of
  4 KiB (does instruction fetch cost?); also the issue cost of code all 32 warps run;
- sums: 2048 sums over every block's partials, as the FFN's end needs them: through slots, a
  reduce wave and two barriers (the plan's way), or through 64-bit fixed-point atomic adds and one
  barrier (exact integer sums, so as reproducible);
- clusters (sm_90): other grid barriers (a flag per block, four counters, a thread-block cluster
  barrier before the counter) with a check that each orders memory, and the FFN's sums with the
  blocks of a cluster combining their partials in distributed shared memory first, or added to
  two copies of the accumulators (cooperative launches with clusters, `cuLaunchKernelEx`);
- tags: the period of a chain of waves (every block writes its slice of a vector, then reads the
  whole of it) synchronised by the grid barrier, or by values that carry their step in a 64-bit
  word so that the read is the wait (relaxed, or release/acquire), with and without work between.

Times are %globaltimer stamps per block and iteration (medians; the first iterations dropped).
The kernels are latency_probe.cu beside this file. What the H200 measured is in docs/MEGAKERNEL.md
("Decisions and their evidence").

    python dev/megakernel/latency_probe.py [--out probe.json] [--parts barrier,vectors,pages,icache,sums,clusters,tags]

Needs an NVIDIA GPU, cuda-bindings and nvcc.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from airframe.megakernel.cuda.build import find_nvcc  # noqa: E402
from airframe.megakernel.cuda.runtime import Device, check  # noqa: E402

PARTS = ("barrier", "vectors", "pages", "icache", "sums", "clusters", "tags")
PAGES = 1024  # 2 MiB pages of the buffer the pages part touches
SOURCE_PATH = Path(__file__).with_name("latency_probe.cu")


def build(arch: str) -> bytes:
    nvcc = find_nvcc()
    if not nvcc:
        raise SystemExit("nvcc not found: the probe compiles its kernels with nvcc")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.cubin"
        subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-O3", str(SOURCE_PATH), "-o", str(out)], check=True)
        return out.read_bytes()


class Probe:
    """The compiled kernels on one device, with the buffers they share."""

    def __init__(self, iters: int):
        self.dev = Device()
        self.cu = self.dev.cu
        module = check(self.cu.cuModuleLoadData(build(self.dev.arch)), "cuModuleLoadData(probe)")
        self.kernels = {name: check(self.cu.cuModuleGetFunction(module, name.encode()), name)
                        for name in ("probe", "pages", "icache", "clocks", "sums", "barriers", "csums", "tags")}
        self.blocks, self.iters = self.dev.sm_count, iters
        self.x = self.dev.alloc(8192 * 4 * self.blocks)
        self.bar = self.dev.alloc(16)
        self.out = self.dev.alloc(8 * iters * self.blocks)

    def launch(self, name: str, grid: int, params: list, cooperative: bool = True, block: int = 1024) -> None:
        """params: (value, numpy dtype) per kernel parameter."""
        arrays = [np.array([value], dtype=dtype) for value, dtype in params]
        ptrs = np.array([a.ctypes.data for a in arrays], dtype=np.uint64)
        cu, kernel = self.cu, self.kernels[name]
        check(cu.cuMemsetD8(self.bar.ptr, 0, 16), "cuMemsetD8")
        if cooperative:
            check(cu.cuLaunchCooperativeKernel(kernel, grid, 1, 1, block, 1, 1, 0, 0, ptrs.ctypes.data), name)
        else:
            check(cu.cuLaunchKernel(kernel, grid, 1, 1, block, 1, 1, 0, 0, ptrs.ctypes.data, 0), name)
        self.dev.synchronize(name)

    def launch_ex(self, name: str, grid: int, params: list, cluster: int) -> None:
        """A cooperative launch with thread-block clusters of `cluster` blocks (sm_90)."""
        arrays = [np.array([value], dtype=dtype) for value, dtype in params]
        ptrs = np.array([a.ctypes.data for a in arrays], dtype=np.uint64)
        cu = self.cu
        check(cu.cuMemsetD8(self.bar.ptr, 0, 16), "cuMemsetD8")
        config = self.cluster_config(grid, cluster)
        check(cu.cuLaunchKernelEx(config, self.kernels[name], ptrs.ctypes.data, 0), f"{name} (clusters of {cluster})")
        self.dev.synchronize(name)

    def cluster_config(self, grid: int, cluster: int):
        cu = self.cu
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = 1024, 1, 1
        config.sharedMemBytes = 0
        dims = cu.CUlaunchAttribute()
        dims.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        dims.value.clusterDim.x, dims.value.clusterDim.y, dims.value.clusterDim.z = cluster, 1, 1
        coop = cu.CUlaunchAttribute()
        coop.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        coop.value.cooperative = 1
        config.attrs = [dims, coop]
        config.numAttrs = 2
        return config

    def times(self, skip: int) -> dict:
        """Summary of out[iteration, block] in ns, the first `skip` iterations dropped."""
        t = self.dev.download(self.out, np.uint64, self.iters * self.blocks).reshape(self.iters, self.blocks)
        t = t[skip:].astype(np.float64)
        return {"median_ns": float(np.median(t)), "median_of_max_ns": float(np.median(t.max(axis=1))),
                "p90_ns": float(np.percentile(t, 90))}

    def clocks(self) -> dict:
        self.launch("clocks", 1, [(self.out.ptr, np.uint64)], cooperative=False, block=1)
        step, span, cycles = self.dev.download(self.out, np.uint64, 3).tolist()
        return {"globaltimer_step_ns": step, "sm_clock_ghz": cycles / span}

    def chain(self, copies: int, n: int, mode: int) -> dict:
        """probe(): mode 0 a vector read, 1 one float, 2 the barrier, 3 writes + barrier + read."""
        self.launch("probe", self.blocks, [(self.x.ptr, np.uint64), (self.bar.ptr, np.uint64), (self.out.ptr, np.uint64),
                                           (self.iters, np.int32), (copies, np.int32), (n, np.int32), (mode, np.int32)])
        return self.times(skip=20)

    def barrier(self) -> dict:
        res = {"barrier": self.chain(1, 2048, 2), "one_load": self.chain(1, 2048, 1)}
        print(f"grid barrier, arrival to release: {res['barrier']}", flush=True)
        print(f"one float another block wrote: {res['one_load']}", flush=True)
        return res

    def vectors(self) -> dict:
        rows = []
        for n in (2048, 8192):
            for copies in (c for c in (1, 2, 4, 8, 16, 33, 66, 132) if c <= self.blocks):
                r = self.chain(copies, n, 0)
                r.update(n=n, copies=copies, write_barrier_read_ns=self.chain(copies, n, 3)["median_of_max_ns"])
                rows.append(r)
                print(f"read {n} floats, {copies:3d} copies: median {r['median_ns']:.0f} ns, slowest block "
                      f"{r['median_of_max_ns']:.0f} ns; writes + barrier + read {r['write_barrier_read_ns']:.0f} ns",
                      flush=True)
        return {"vector": rows}

    def pages(self) -> dict:
        big = self.dev.alloc(PAGES << 21, zero=False)
        rows = []
        try:
            for n_pages, scatter in ((0, 0), (8, 0), (32, 0), (128, 0), (512, 0), (1024, 0), (0, 1), (128, 1), (1024, 1)):
                self.launch("pages", self.blocks, [(self.x.ptr, np.uint64), (self.bar.ptr, np.uint64),
                                                   (self.out.ptr, np.uint64), (big.ptr, np.uint64), (self.iters, np.int32),
                                                   (n_pages, np.int32), (scatter, np.int32)])
                r = dict(self.times(skip=20), pages=n_pages, scatter=scatter)
                rows.append(r)
                print(f"one fresh float ({'4-byte stores' if scatter else 'warp store'}) after touching "
                      f"{n_pages:4d} other 2 MiB pages: median {r['median_ns']:.0f} ns, slowest block "
                      f"{r['median_of_max_ns']:.0f} ns", flush=True)
        finally:
            self.dev.free(big)
        return {"pages": rows}

    def sums(self) -> dict:
        slots = self.dev.alloc(4 * 2048 * self.blocks)
        total = self.dev.alloc(4 * 2048)
        acc = self.dev.alloc(8 * 2048)
        rows = []
        try:
            for stagger in (0, 1000, 2000):
                for mode, name in ((0, "slots + reduce wave"), (1, "fixed-point atomics")):
                    self.launch("sums", self.blocks, [(slots.ptr, np.uint64), (total.ptr, np.uint64), (acc.ptr, np.uint64),
                                                      (self.bar.ptr, np.uint64), (self.out.ptr, np.uint64),
                                                      (self.iters, np.int32), (mode, np.int32), (stagger, np.int32)])
                    r = dict(self.times(skip=20), mode=name, stagger_ns=stagger)
                    rows.append(r)
                    print(f"2048 sums over {self.blocks} blocks, {name}, finishes spread over {stagger} ns: "
                          f"median {r['median_ns']:.0f} ns, slowest block {r['median_of_max_ns']:.0f} ns", flush=True)
        finally:
            for buf in (slots, total, acc):
                self.dev.free(buf)
        return {"sums": rows}

    def launch_any(self, name: str, params: list, cluster: int) -> str | None:
        """A cooperative launch of every block, in clusters when cluster > 1; the error, if any."""
        try:
            if cluster == 1:
                self.launch(name, self.blocks, params)
            else:
                self.launch_ex(name, self.blocks, params, cluster)
        except Exception as exc:  # noqa: BLE001 - reported with the measurement, not fatal
            return str(exc)
        return None

    def clusters(self) -> dict:
        """Barrier forms and the FFN's end combined in thread-block clusters (sm_90)."""
        if int(self.dev.arch.split("_")[1]) < 90:
            print(f"clusters: thread-block clusters need sm_90, this GPU is {self.dev.arch}", flush=True)
            return {"clusters": f"not run: {self.dev.arch} has no thread-block clusters"}
        res = {}
        for cluster in (2, 4):
            try:
                found = check(self.cu.cuOccupancyMaxActiveClusters(self.kernels["barriers"],
                                                                   self.cluster_config(self.blocks, cluster)),
                              "cuOccupancyMaxActiveClusters")
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                found = f"error: {exc}"
            res[f"max_active_clusters_{cluster}"] = found
            print(f"clusters of {cluster} x 1024 threads that fit at once: {found}", flush=True)
        errors = self.dev.alloc(4)
        try:
            res.update(barrier_forms=self.barrier_forms(errors), cluster_sums=self.cluster_sums(errors))
        finally:
            self.dev.free(errors)
        return res

    BARRIER_FORMS = ("counter", "flags, relaxed polls + fence", "flags, acquire polls", "flags on their own sectors",
                     "four counters", "cluster barrier + counter of clusters", "cluster barrier alone")

    def barrier_forms(self, errors) -> list:
        """barriers(): each form's arrival-to-release time and its stale reads (0: it orders memory)."""
        flags = self.dev.alloc(4 * 4096)  # the forms' flags and counters
        out = self.dev.alloc(8 * 2 * self.iters * self.blocks)  # [arrival to release, + the read][iteration][block]
        rows = []
        try:
            for form, name in enumerate(self.BARRIER_FORMS):
                for cluster in {5: (2, 4), 6: (2,)}.get(form, (1, 2)):
                    check(self.cu.cuMemsetD8(flags.ptr, 0, 4 * 4096), "memset")
                    check(self.cu.cuMemsetD8(errors.ptr, 0, 4), "memset")
                    params = [(self.x.ptr, np.uint64), (flags.ptr, np.uint64), (out.ptr, np.uint64),
                              (errors.ptr, np.uint64), (self.iters, np.int32), (form, np.int32)]
                    error = self.launch_any("barriers", params, cluster)
                    if error:
                        print(f"barrier {name}, clusters of {cluster}: {error}", flush=True)
                        rows.append({"form": name, "cluster": cluster, "error": error})
                        continue
                    t = self.dev.download(out, np.uint64, 2 * self.iters * self.blocks).reshape(2, self.iters, self.blocks)
                    t = t[:, 20:].astype(np.float64)
                    r = {"form": name, "cluster": cluster, "median_ns": float(np.median(t[0])),
                         "p90_ns": float(np.percentile(t[0], 90)), "with_read_median_ns": float(np.median(t[1])),
                         "stale_reads": int(self.dev.download(errors, np.uint32, 1)[0])}
                    rows.append(r)
                    print(f"barrier {name:40s} clusters of {cluster}: arrival to release median "
                          f"{r['median_ns']:.0f} ns (p90 {r['p90_ns']:.0f}), + read {r['with_read_median_ns']:.0f} ns, "
                          f"stale reads {r['stale_reads']}", flush=True)
        finally:
            for buf in (flags, out):
                self.dev.free(buf)
        return rows

    def cluster_sums(self, errors) -> list:
        """csums(): the FFN's 2048 sums by atomics, after combining in clusters, or in two copies."""
        acc = self.dev.alloc(8 * 4096)
        rows = []
        try:
            for mode, cluster, name in ((1, 1, "atomics"), (1, 2, "atomics (cluster launch)"), (2, 2, "pairs combine first"),
                                        (2, 4, "quads combine first"), (3, 1, "two accumulator copies")):
                check(self.cu.cuMemsetD8(errors.ptr, 0, 4), "memset")
                params = [(acc.ptr, np.uint64), (self.bar.ptr, np.uint64), (self.out.ptr, np.uint64),
                          (errors.ptr, np.uint64), (self.iters, np.int32), (mode, np.int32)]
                error = self.launch_any("csums", params, cluster)
                if error:
                    print(f"2048 sums, {name}: {error}", flush=True)
                    rows.append({"mode": name, "cluster": cluster, "error": error})
                    continue
                r = dict(self.times(skip=20), mode=name, cluster=cluster,
                         wrong=int(self.dev.download(errors, np.uint32, 1)[0]))
                rows.append(r)
                print(f"2048 sums, {name:28s}: median {r['median_ns']:.0f} ns, slowest block "
                      f"{r['median_of_max_ns']:.0f} ns, wrong {r['wrong']}", flush=True)
        finally:
            self.dev.free(acc)
        return rows

    def icache(self) -> dict:
        rows = []
        for kinds in (1, 2, 4, 8, 16, 24, 32, 48):
            self.launch("icache", self.blocks, [(self.out.ptr, np.uint64), (self.bar.ptr, np.uint64),
                                                (self.iters, np.int32), (kinds, np.int32)], cooperative=False)
            r = dict(self.times(skip=2 * kinds), kinds=kinds, code_kib=kinds * 256 * 16 / 1024)
            rows.append(r)
            print(f"256 dependent FMAs, {kinds:2d} bodies in turn ({r['code_kib']:.0f} KiB of code): median "
                  f"{r['median_ns']:.0f} ns, slowest block {r['median_of_max_ns']:.0f} ns", flush=True)
        return {"icache": rows}

    def tags(self) -> dict:
        """The period of a chain of waves: write a slice, wait for the whole vector, read it, work."""
        words = self.dev.alloc(8 * 2 * 8192)
        check_word = self.dev.alloc(4)
        rows, step0 = [], 1
        try:
            for work_ns in (0, 2000):
                for n in (2048, 8192):
                    for mode, name in ((0, "grid barrier, then read"), (1, "step-tagged words, relaxed"),
                                       (2, "step-tagged words, release/acquire")):
                        check(self.cu.cuMemsetD8(check_word.ptr, 0, 4), "cuMemsetD8")
                        self.launch("tags", self.blocks, [
                            (self.x.ptr, np.uint64), (words.ptr, np.uint64), (self.bar.ptr, np.uint64),
                            (self.out.ptr, np.uint64), (check_word.ptr, np.uint64), (self.iters, np.int32),
                            (n, np.int32), (mode, np.int32), (work_ns, np.int32), (step0, np.uint32)])
                        step0 += self.iters  # a later launch never mistakes an old word for its own
                        t = self.dev.download(self.out, np.uint64, self.iters * self.blocks)
                        period = np.diff(t.reshape(self.iters, self.blocks).astype(np.float64), axis=0)[20:]
                        median = float(np.median(period))
                        r = {"mode": name, "n": n, "work_ns": work_ns, "period_ns": median,
                             "sync_ns": median - work_ns,
                             "wrong": int(self.dev.download(check_word, np.uint32, 1)[0])}
                        rows.append(r)
                        print(f"wave of {n} floats, work {work_ns} ns, {name:36s}: period {r['period_ns']:.0f} ns, "
                              f"beyond the work {r['sync_ns']:.0f} ns, wrong {r['wrong']}", flush=True)
        finally:
            self.dev.free(words)
            self.dev.free(check_word)
        return {"tags": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--iters", type=int, default=400, help="iterations of each measurement")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of " + ", ".join(PARTS))
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part {unknown[0]!r}, expected some of {', '.join(PARTS)}")
    probe = Probe(args.iters)
    res = {"device": probe.dev.name, "sm": probe.blocks, **probe.clocks()}
    print(f"{res['device']}, {res['sm']} SMs: globaltimer step {res['globaltimer_step_ns']} ns, "
          f"SM clock {res['sm_clock_ghz']:.3f} GHz", flush=True)
    for part in parts:
        res.update(getattr(probe, part)())
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
