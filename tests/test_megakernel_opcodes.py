"""The plan format's single source of truth and the CUDA header generated from it."""

import ast
from pathlib import Path

import numpy as np

from airframe.megakernel.plan import opcodes
from airframe.megakernel.plan.opcodes import OPCODE_DOCS, TASK_DTYPE, TASK_FIELDS, Op, Task, task_from_word, tasks_to_array


def test_committed_header_is_generated_from_opcodes_py():
    assert opcodes.HEADER_PATH.read_text() == opcodes.render_header(), \
        "plan_format.h is stale: run `python -m airframe.megakernel.plan.opcodes`"


def test_plan_never_imports_cuda():
    # the rooms follow the data flow: plan/ is pure CPU, cuda/ builds on it, never the other way
    plan_dir = Path(opcodes.__file__).parent
    for path in plan_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or "", *(a.name for a in node.names)] if isinstance(node, ast.ImportFrom)
                     else [])
            for name in names:
                assert "cuda" not in name.split("."), f"{path.name} imports {name}"
    assert opcodes.HEADER_PATH.parent.name == "cuda"  # the worker includes it: it lives beside worker.cu


def test_task_word_is_80_bytes_with_u64_fields_aligned():
    assert TASK_DTYPE.itemsize == 80 and TASK_DTYPE.itemsize % 16 == 0  # copied as 16-byte vectors
    for name, kind, _ in TASK_FIELDS:
        offset = TASK_DTYPE.fields[name][1]
        assert offset % (8 if kind == "u64" else 4) == 0, name


def test_header_declares_every_opcode_and_field_at_its_offset():
    text = opcodes.render_header()
    for op in Op:
        assert f"AF_OP_{op.name} = {op.value}," in text
        assert op in OPCODE_DOCS
    for name in TASK_DTYPE.names:
        assert f"__builtin_offsetof(af_task, {name}) == {TASK_DTYPE.fields[name][1]}" in text
    for name in opcodes.CONST_NAMES:
        assert f" {name};" in text


def test_task_words_round_trip_through_bytes():
    tasks = np.zeros(3, dtype=TASK_DTYPE)
    tasks["opcode"] = [Op.QKV, Op.ATTN, Op.LM_HEAD]
    tasks["weight0"] = [0, 1 << 33, (1 << 40) + 6]
    again = np.frombuffer(tasks.tobytes(), dtype=TASK_DTYPE)
    assert again.tobytes() == tasks.tobytes()
    words = np.frombuffer(tasks.tobytes(), dtype="<u4").reshape(3, 20)
    assert words[1, 8] == 0 and words[1, 9] == 2  # u64 weight0 = (lo, hi) words 8, 9


def test_task_objects_and_words_are_the_same_fields():
    task = Task(opcode=Op.FFN, wave=4, worker=7, layer=2, row_start=100, row_count=62, slot=7,
                weight0=1 << 35, weight1=5, weight2=6, norm=8)
    array = tasks_to_array([task])
    assert array.dtype == TASK_DTYPE and task_from_word(array[0]) == task
    assert [f for f, _, _ in TASK_FIELDS] == list(Task.__dataclass_fields__)
