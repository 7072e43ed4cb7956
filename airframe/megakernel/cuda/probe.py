"""Probe the GPU with the compiled worker: the target description a plan is made for.

The probe builds worker.cu for this GPU's architecture, loads it, asks the driver how many
1024-thread blocks of it fit on one SM with the shared memory a worker may use, measures the
streaming-read bandwidth with the worker module's own read kernel, and writes the result as the
target JSON that the planner takes (`--target FILE.json`). The JSON carries the sha256 of the
worker binary: the fingerprint of every plan made from it, which the runtime checks.

    python -m airframe.megakernel.cuda.probe -o target.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from ...errors import AirframeError, GPUError
from ..plan.target import Target, target_to_dict
from .runtime import Device, Worker


def probe(device: Device | None = None, worker: Worker | None = None, bandwidth: bool = True) -> Target:
    """The target description of this GPU running the compiled worker."""
    device = device or Device()
    worker = worker or Worker(device)
    dynamic = device.shared_optin - worker.static_shared
    per_sm = worker.blocks_per_sm(dynamic)
    if per_sm < 1:
        raise GPUError(f"the worker ({worker.registers} registers, {worker.threads} threads) does not fit on one SM "
                       f"of {device.name} with {device.shared_optin} B of shared memory; expected one block per SM")
    if not device.cooperative:
        raise GPUError(f"{device.name} does not support cooperative launches, which the worker needs")
    gbs = worker.stream_read_gbs() if bandwidth else 1.0
    return Target(name=device.name.replace(" ", "-").lower(), arch=device.arch, workers=device.sm_count,
                  threads_per_worker=worker.threads, shared_bytes=dynamic,
                  registers_per_thread=worker.registers, bandwidth_gbs=round(gbs, 1),
                  binary_sha256=worker.build.sha256)


def with_workers(target: Target, workers: int) -> Target:
    """The same worker binary planned for fewer workers (e.g. 20, the RTX 3050's SMs)."""
    return replace(target, workers=workers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", help="write the target JSON here (default: print it)")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the streaming-read measurement")
    args = parser.parse_args(argv)
    try:
        device = Device()
        worker = Worker(device)
        target = probe(device, worker, bandwidth=not args.no_bandwidth)
    except AirframeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(target_to_dict(target), indent=1)
    print(f"{device.name}: {worker.build.summary()}; {worker.local_bytes} B local per thread", file=sys.stderr)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
