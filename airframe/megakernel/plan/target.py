"""What a plan is made for: the GPU's workers and the worker binary that runs them.

A target is a small JSON description. Two are named (`rtx3050`, `h200`); the probe of the
compiled worker (cuda/probe.py) writes the same JSON with the measured occupancy and the binary's
sha256, and `--target FILE.json` takes it. The plan's fingerprint binds a package to one
plan_format.h and one worker binary (a named target without a binary: to the target itself).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ...errors import ParameterError
from .opcodes import header_sha256


@dataclass(frozen=True)
class Target:
    name: str
    arch: str  # "sm_86"
    workers: int  # persistent blocks, one per SM
    threads_per_worker: int
    shared_bytes: int  # dynamic shared memory a worker may use
    registers_per_thread: int
    bandwidth_gbs: float  # measured streaming read, for the ideal time in pictures
    binary_sha256: str | None = None  # the compiled worker, when the probe made this description


NAMED_TARGETS = {
    # RTX 3050: 20 SMs, one 1024-thread block each at 64 registers, 212.9 GB/s measured.
    "rtx3050": Target("rtx3050", "sm_86", 20, 1024, 99 * 1024, 64, 212.9),
    # H200: 132 SMs, 4.53 TB/s streaming read.
    "h200": Target("h200", "sm_90", 132, 1024, 227 * 1024, 64, 4530.0),
}

_INT_FIELDS = ("workers", "threads_per_worker", "shared_bytes", "registers_per_thread")


def target_from_dict(data: dict, where: str = "target") -> Target:
    """A Target from its JSON form, each field checked."""
    if not isinstance(data, dict):
        raise ParameterError(f"{where}: found {type(data).__name__}, expected a JSON object")
    missing = [f for f in ("name", "arch", *_INT_FIELDS, "bandwidth_gbs") if f not in data]
    if missing:
        raise ParameterError(f"{where}: missing fields {', '.join(missing)}")
    for name in _INT_FIELDS:
        value = data[name]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ParameterError(f"{where}: {name} = {value!r}, expected a positive integer")
    bandwidth = data["bandwidth_gbs"]
    if not isinstance(bandwidth, (int, float)) or isinstance(bandwidth, bool) or bandwidth <= 0:
        raise ParameterError(f"{where}: bandwidth_gbs = {bandwidth!r}, expected a positive number")
    binary = data.get("binary_sha256")
    if binary is not None and (not isinstance(binary, str) or len(binary) != 64):
        raise ParameterError(f"{where}: binary_sha256 = {binary!r}, expected 64 hex digits or null")
    return Target(str(data["name"]), str(data["arch"]), *(data[n] for n in _INT_FIELDS),
                  float(bandwidth), binary)


def target_to_dict(target: Target) -> dict:
    return asdict(target)


def load_target(name_or_path: str, workers: int | None = None) -> Target:
    """A named target or a target JSON file; `workers` overrides the worker count."""
    if name_or_path in NAMED_TARGETS:
        target = NAMED_TARGETS[name_or_path]
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ParameterError(f"target {name_or_path!r} is neither a named target "
                                 f"({', '.join(NAMED_TARGETS)}) nor a JSON file")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ParameterError(f"{path}: not valid JSON ({e})") from None
        target = target_from_dict(data, str(path))
    if workers is not None:
        if workers <= 0:
            raise ParameterError(f"--workers {workers}, expected a positive count")
        target = replace(target, workers=workers)
    return target


def fingerprint(target: Target, header_text: str | None = None) -> dict:
    """What a package is bound to: the plan_format.h hash plus the worker binary's hash.

    A target with no binary (a named one) binds the canonical target description instead. The
    runtime recomputes this and refuses a package whose value differs.
    """
    header = header_sha256(header_text)
    if target.binary_sha256:
        basis = {"header_sha256": header, "binary_sha256": target.binary_sha256}
    else:
        basis = {"header_sha256": header, "target": target_to_dict(target)}
    digest = hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()
    return {"header_sha256": header, "binary_sha256": target.binary_sha256, "fingerprint": digest}
