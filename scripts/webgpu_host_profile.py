#!/usr/bin/env python3
"""Where the host's time goes in WebGPU decoding: `python scripts/webgpu_host_profile.py MODEL`.

Prints the chained greedy ms/token (context 1, 64 tokens), the CPU time of the pieces of a token
(building and recording its dispatches, a write_buffer, a submit, an empty round trip), then
cProfile's top entries for a 64-token chain and for 32 tokens with the logits read back.
"""
import cProfile, pstats, statistics, sys, time
import numpy as np
import wgpu
from airframe.gpu.runtime import WebGPUBackend
from airframe.gpu import kernels as K
from airframe.gpu.greedy import chain
from airframe.model import open_model
from airframe.options import RunOptions

be = WebGPUBackend.load(open_model(sys.argv[1]), RunOptions(n_ctx=600))
dev, q = be.ctx.device, be.ctx.device.queue

def med(f, n=100):
    xs = []
    for _ in range(n):
        s = time.perf_counter(); f(); xs.append(time.perf_counter() - s)
    return 1000 * statistics.median(xs)

def run_chain(n=64):
    be.reset(); be.forward([1])
    t0 = time.perf_counter()
    for ids, fin in chain(be, 5, n):
        pass
    q.submit([]); return 1000 * (time.perf_counter() - t0) / n

for _ in range(3): run_chain()
print("chain ms/token", [round(run_chain(), 3) for _ in range(3)])
d = be.dispatches(1) + be.globals_ops.final_norm(1) + be.globals_ops.lm_head(1) + be.argmax.dispatches
print("dispatches", len(d))
print("build list", med(lambda: be.dispatches(1) + be.globals_ops.final_norm(1) + be.globals_ops.lm_head(1)))
def rec():
    e = dev.create_command_encoder(); K.record(e, d); return e.finish()
print("record+finish", med(rec))
print("encoder+finish empty", med(lambda: dev.create_command_encoder().finish()))
buf = be.scratch.step
print("write_buffer 16 B", med(lambda: q.write_buffer(buf, 0, np.zeros(4, np.uint32))))
print("write_step", med(lambda: be._write_step(1)))
cbs = [rec() for _ in range(60)]
it = iter(cbs)
print("submit recorded token (GPU runs)", med(lambda: q.submit([next(it)]), 50))
st = be.argmax.staging[0]
def rt():
    q.submit([dev.create_command_encoder().finish()]); st.map_sync(wgpu.MapMode.READ, 0, 16); st.read_mapped(0, 16, copy=True); st.unmap()
print("empty submit + 16 B map", med(rt, 50))
be.reset(); be.forward([1])
pr = cProfile.Profile(); pr.enable()
for ids, fin in chain(be, 5, 64): pass
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
be.reset(); be.forward([1])
pr = cProfile.Profile(); pr.enable()
for _ in range(32): be.forward([1])
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(14)
