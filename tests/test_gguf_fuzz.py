"""The GGUF loading path under mutation fuzzing (tests/gguf_fuzz.py): every mutant of every base
model gives the project's own error or loads, within the time limit and the memory limit.

CI runs a few cases of every mutation class on a tiny synthetic model of each family and on the
real SmolLM2 and Gemma 3 files; `pytest tests/test_gguf_fuzz.py --fuzz-long -s` runs 10,000 of
each base and prints the table docs/ROBUSTNESS.md records.
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


@pytest.fixture(scope="module")
def bases(tmp_path_factory, smollm2_path, gemma3_path) -> list[fz.Base]:
    folder = tmp_path_factory.mktemp("fuzz-bases")
    tiny = [fz.Base(f"tiny {family}", write_synthetic_gguf(folder / f"{family}.gguf", family, "tiny", "Q8_0"),
                    deep=True) for family in sorted(families_by_name())]
    return tiny + [fz.Base("SmolLM2 135M", smollm2_path, deep=False), fz.Base("Gemma 3 270M", gemma3_path, deep=False)]


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


def test_every_mutant_loads_or_gives_the_projects_error(bases, work_folder, request):
    long = request.config.getoption("--fuzz-long")
    cases = []
    for b in bases:
        cases += fz.plan([b], LONG_CASES if long else CI_CASES["tiny" if b.deep else "real"])
    done = [0]
    start = time.monotonic()

    def progress(case):
        done[0] += 1
        if long and done[0] % 2000 == 0:
            print(f"{done[0]:,}/{len(cases):,} cases, {time.monotonic() - start:.0f} s\n"
                  f"{fz.table([c for c in cases if c.outcome])}", file=sys.stderr, flush=True)

    fz.Fuzzer(bases, work_folder).run(cases, progress)
    print("\n" + fz.table(cases))
    bugs = [c for c in cases if c.outcome.startswith("BUG")]
    assert not bugs, f"{len(bugs)} of {len(cases)} cases escaped; first:\n" + "\n".join(
        f"{c.base} / {c.mutation} #{c.index} ({c.what}):\n{c.outcome}" for c in bugs[:3])
    for mutation in fz.MUTATIONS:  # each class reaches the checks: some of its mutants are refused
        assert any(c.outcome.startswith("error") for c in cases if c.mutation == mutation), mutation
    assert any(c.outcome.startswith("loaded") for c in cases), "no mutant loaded: the loading path never ran"
