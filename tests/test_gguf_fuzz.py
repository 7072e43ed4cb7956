"""The GGUF loading path under mutation fuzzing (tests/gguf_fuzz.py): every mutant of every base
model gives the project's own error or loads, within the time limit and the memory limit.

CI runs a few cases of every mutation class on a tiny synthetic model of each family and on the
real SmolLM2, Gemma 3 and Qwen2.5 0.5B files; `pytest tests/test_gguf_fuzz.py --fuzz-long -s` runs 10,000 of
each base and prints the tables docs/ROBUSTNESS.md records (`-k Gemma` picks one base).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

import gguf_fuzz as fz
from airframe.family import families_by_name
from airframe.synthetic import write_synthetic_gguf

CI_CASES = {"tiny": 30, "real": 10}  # per base: each class 3 (tiny) or 1 (real) times
LONG_CASES = 10_000


TINY = sorted(families_by_name())
BASES = [f"tiny {family}" for family in TINY] + ["SmolLM2 135M", "Gemma 3 270M", "Qwen2.5 0.5B"]


@pytest.fixture
def base(request, tmp_path) -> fz.Base:
    name = request.param
    real = {"SmolLM2 135M": "smollm2_path", "Gemma 3 270M": "gemma3_path", "Qwen2.5 0.5B": "qwen05_path"}
    if name in real:
        return fz.Base(name, request.getfixturevalue(real[name]), deep=False)
    family = name.removeprefix("tiny ")
    return fz.Base(name, write_synthetic_gguf(tmp_path / f"{family}.gguf", family, "tiny", "Q8_0"), deep=True)


def test_the_working_copy_is_each_mutant_exactly(smollm2_path, tmp_path):
    """The harness itself: after each write the copy holds head + data, patched and cut, whatever
    the mutant before it did."""
    base = fz.Base("SmolLM2 135M", smollm2_path, deep=False)
    data = smollm2_path.read_bytes()[base.layout.data_offset:]
    work = fz.WorkFile(base, tmp_path / "work.gguf")
    for case in fz.plan([base], 30):
        m = fz.mutant(base, case.mutation, case.index)
        work.write(m)
        expected = bytearray(m.head + data)
        for pos, patch in m.patches:
            expected[len(m.head) + pos:len(m.head) + pos + len(patch)] = patch
        if m.cut is not None:
            del expected[m.cut:]
        assert work.path.read_bytes() == expected, m.what
        work.restore()


@pytest.fixture
def work_folder(tmp_path):
    """Where the workers' copies live: memory (/dev/shm) when there is one, as they are rewritten often."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="airframe-fuzz-", dir=shm))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("base", BASES, indirect=True)
def test_every_mutant_loads_or_gives_the_projects_error(base, work_folder, request):
    long = request.config.getoption("--fuzz-long")
    cases = fz.plan([base], LONG_CASES if long else CI_CASES["tiny" if base.deep else "real"],
                    request.config.getoption("--fuzz-first"))
    done = [0]
    start = time.monotonic()

    def progress(case):
        done[0] += 1
        if long and done[0] % 500 == 0:
            print(f"{base.name}: {done[0]:,}/{len(cases):,} cases, {time.monotonic() - start:.0f} s\n"
                  f"{fz.table([c for c in cases if c.outcome])}", file=sys.stderr, flush=True)

    fz.Fuzzer([base], work_folder, request.config.getoption("--fuzz-workers")).run(cases, progress)
    print("\n" + fz.table(cases))
    bugs = [c for c in cases if c.outcome.startswith("BUG")]
    assert not bugs, f"{len(bugs)} of {len(cases)} cases escaped; first:\n" + "\n".join(
        f"{c.base} / {c.mutation} #{c.index} ({c.what}):\n{c.outcome}" for c in bugs[:3])
    refused = {c.mutation for c in cases if c.outcome.startswith("error")}
    assert refused, "no mutant was refused: the mutations never reached the checks"
    # each class reaches the checks: some of its mutants are refused (noise in the real models'
    # weights only where the deep path's --check-tensors sees it)
    if long and len(cases) >= 1000 and base.deep:
        assert refused == set(fz.MUTATIONS), set(fz.MUTATIONS) - refused
