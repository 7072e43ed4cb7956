"""Decode batches on lavapipe (WebGPUBackend.decode_batch): the tokens of several slots in one forward,
each weight read once for all of them, give each slot the logits it gets alone, bit for bit, with
slots at different lengths, joining and leaving between steps, a slot left out untouched; on tiny
synthetic models of three types through gemv.wgsl (tiled) and gemm_rows.wgsl (CPU adapters), and
the base Backend's slot-by-slot loop on the reference backend. The kernels themselves are checked
against numpy in test_gpu_matmul.py and test_gpu_attention.py."""

import dataclasses

import numpy as np
import pytest

from airframe.backend import Pick
from airframe.errors import ContextOverflowError, NonFiniteError, ParameterError
from airframe.gpu import candidates as cand
from airframe.gpu.backend import ROW_CANDIDATES, ROW_LOGITS, WebGPUBackend
from airframe.model import open_model
from airframe.options import RunOptions
from airframe.reference import ReferenceBackend
from airframe.sampling import History, Sampler, SamplingParams
from airframe.synthetic import write_synthetic_gguf

PROMPTS = {2: [7, 300, 2900, 12, 9, 2048, 77, 5, 1, 999, 3, 1321, 18], 0: [5, 6], 3: [42, 43, 44, 45, 46, 47, 48, 49, 50]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {q: write_synthetic_gguf(folder / f"tiny-{q}.gguf", "llama", "tiny", q, vocab=3000)
            for q in ("Q8_0", "Q4_K", "BF16")}


def alone(be, slot: int, prompt: list[int], steps: int) -> list[np.ndarray]:
    """Logits of `prompt`'s last token and of `steps` greedy tokens after it, slot by itself."""
    be.select_slot(slot)
    be.reset()
    be.forward(prompt[:-1])
    out = [be.forward(prompt[-1:])]
    for _ in range(steps):
        out.append(be.forward([int(np.argmax(out[-1]))]))
    return out


def batched(be, steps: int, leaves: dict[int, int]) -> dict[int, list[np.ndarray]]:
    """The same, every slot of PROMPTS in one decode batch per step; slot s leaves after step leaves[s]."""
    for slot, prompt in PROMPTS.items():
        be.select_slot(slot)
        be.reset()
        be.forward(prompt[:-1])
    be.select_slot(1)
    out = {slot: [] for slot in PROMPTS}
    nxt = {slot: prompt[-1] for slot, prompt in PROMPTS.items()}
    for step in range(steps + 1):
        entries = [(slot, nxt[slot]) for slot in PROMPTS if step <= leaves.get(slot, steps)]
        logits = be.decode_batch(entries)
        for (slot, _), row in zip(entries, logits):
            out[slot].append(row)
            nxt[slot] = int(np.argmax(row))
    return out


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "BF16"])
@pytest.mark.parametrize("matmul", ["tiled", "rows"])
def test_a_batch_gives_each_slot_its_own_logits(models, qtype, matmul):
    be = WebGPUBackend.load(open_model(models[qtype]), RunOptions(n_ctx=80, prefill_chunk=8, slots=4, matmul=matmul))
    steps, leaves = 5, {0: 2}
    want = {slot: alone(be, slot, prompt, steps if slot not in leaves else leaves[slot]) for slot, prompt in PROMPTS.items()}
    be.select_slot(1)
    be.reset()
    be.forward([11, 12, 13])
    got = batched(be, steps, leaves)
    assert be.slot == 1 and be.n_past == 3  # the selected slot, left out of every batch
    for slot in PROMPTS:
        assert len(got[slot]) == len(want[slot])
        for a, b in zip(got[slot], want[slot]):
            np.testing.assert_array_equal(a, b)
        be.select_slot(slot)
        assert be.n_past == len(PROMPTS[slot]) + len(want[slot]) - 1
    be.select_slot(1)
    np.testing.assert_array_equal(be.forward([14]), alone(be, 1, [11, 12, 13, 14], 0)[0])


def test_one_forward_serves_a_batch(models, monkeypatch):
    """The slots of one K/V buffer run as one forward: one command buffer for three tokens."""
    be = WebGPUBackend.load(open_model(models["Q8_0"]), RunOptions(n_ctx=32, slots=3, matmul="tiled"))
    assert be.group_slots == 3
    steps = []
    step = be._batch_step
    monkeypatch.setattr(be, "_batch_step", lambda entries, full, **kw: steps.append(len(entries)) or step(entries, full, **kw))
    assert be.decode_batch([(0, 1), (1, 2), (2, 3)]).shape == (3, 3000)
    assert steps == [3]


def start(be, prompts: dict[int, list[int]] = PROMPTS) -> dict[int, int]:
    """Every slot of `prompts` reset and holding its prompt but the last id, which runs next."""
    for slot, prompt in prompts.items():
        be.select_slot(slot)
        be.reset()
        be.forward(prompt[:-1])
    return {slot: prompt[-1] for slot, prompt in prompts.items()}


def greedy_pick(slot: int, with_logits: bool = False) -> Pick:
    return Pick(Sampler(SamplingParams(temperature=0.0), 3000), History(list(PROMPTS[slot]), len(PROMPTS[slot])),
                greedy=True, with_logits=with_logits)


@pytest.mark.parametrize("matmul", ["tiled", "rows"])
def test_greedy_rows_get_their_argmax_from_the_gpu(models, matmul):
    """decode_batch_pick: a greedy row's id is the argmax of the logits decode_batch gives it (the
    batch argmax on the GPU), and only the row that asks for its logits reads them back."""
    be = WebGPUBackend.load(open_model(models["Q4_K"]), RunOptions(n_ctx=80, prefill_chunk=8, slots=4, matmul=matmul))
    want = batched(be, 3, {})
    nxt = start(be)
    picks = [greedy_pick(slot, with_logits=slot == 3) for slot in nxt]
    for step in range(4):
        entries = list(nxt.items())
        rows = be.decode_batch_pick(entries, picks)
        for (slot, _), picked in zip(entries, rows):
            assert picked.token == int(np.argmax(want[slot][step])) and picked.error is None
            if slot == 3:
                np.testing.assert_array_equal(picked.logits, want[slot][step])
            else:
                assert picked.logits is None
            nxt[slot] = picked.token


def greedy_steps(be, nxt: dict[int, int], steps: int, out: dict[int, list[int]]) -> None:
    """`steps` decode_batch_pick steps of every slot of `nxt`, all rows greedy: their ids into `out`."""
    picks = {slot: greedy_pick(slot) for slot in nxt}
    for _ in range(steps):
        entries = list(nxt.items())
        for (slot, _), picked in zip(entries, be.decode_batch_pick(entries, [picks[s] for s, _ in entries])):
            assert picked.error is None
            out.setdefault(slot, []).append(picked.token)
            nxt[slot] = picked.token


def test_greedy_batches_chain_on_the_gpu(models, monkeypatch):
    """With every row greedy the next step is queued before a step is read, its ids the argmax
    copied on the GPU: the tokens are those of decode_batch's logits, the host writes the ids of
    the first step only, and a chained step is left unread where the batch changes (a slot leaves,
    a slot outside the batch runs a prompt, a slot of the batch restarts), the tokens unchanged."""
    be = WebGPUBackend.load(open_model(models["Q4_K"]), RunOptions(n_ctx=80, prefill_chunk=8, slots=4, matmul="tiled"))
    want = {slot: [int(np.argmax(row)) for row in rows] for slot, rows in batched(be, 9, {0: 4}).items()}
    written = []
    dispatches = be.batch_dispatches
    monkeypatch.setattr(be, "batch_dispatches", lambda e, ids=True: written.append(ids) or dispatches(e, ids))
    nxt = start(be)
    got: dict[int, list[int]] = {}
    greedy_steps(be, nxt, 5, got)
    assert written == [True] + [False] * 5  # one step from the host's ids, then each queued behind the last
    del nxt[0]  # slot 0 leaves: the step chained for all three is not taken
    be.select_slot(1)  # a prompt on a slot outside the batch leaves the chained step valid
    be.reset()
    be.forward([11, 12, 13])
    greedy_steps(be, nxt, 5, got)
    assert written[6:] == [True] + [False] * 5
    assert got == want
    be.select_slot(2)  # slot 2 starts again: the step chained for it is void
    be.reset()
    be.forward(PROMPTS[2][:-1])
    again = {2: PROMPTS[2][-1], 3: nxt[3]}
    assert be._chained is None
    more: dict[int, list[int]] = {}
    greedy_steps(be, again, 2, more)
    assert more[2] == want[2][:2] and written[12] is True


def test_a_chain_of_greedy_batches_stops_at_the_context(models):
    """The step after the last position is never queued: a batch runs to the full context."""
    be = WebGPUBackend.load(open_model(models["Q8_0"]), RunOptions(n_ctx=16, slots=4, matmul="tiled"))
    nxt = start(be, {0: [5, 6, 7], 3: [9, 10]})
    got: dict[int, list[int]] = {}
    greedy_steps(be, nxt, 14, got)  # slot 0 runs positions 2..15, the last one
    assert be.slot_past[0] == 16 and be._chained is None
    with pytest.raises(ContextOverflowError):
        be.decode_batch_pick([(0, nxt[0])], [greedy_pick(0)])
    want = alone(be, 0, [5, 6, 7], 13)
    assert got[0] == [int(np.argmax(row)) for row in want]


# sampled rows reduced to candidates (top-k; a top-p within them and a repetition window; min-p, presence, bias),
# an open top-p that reaches past the candidates, and one that cannot be reduced
SAMPLED = {
    2: SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0, repeat_penalty=1.1, seed=1),
    0: SamplingParams(temperature=1.0, top_k=0, top_p=0.03, min_p=0.0, repeat_penalty=1.3, repeat_last_n=8, seed=2),
    3: SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.3, presence_penalty=0.5,
                      logit_bias={11: 4.0, 12: -100.0}, seed=3),
}
OPEN = SamplingParams(temperature=1.5, top_k=0, top_p=0.9999, min_p=0.0, seed=4)       # past the candidates
UNREDUCED = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, frequency_penalty=0.4, seed=5)


SAMPLED_PROMPTS = {**PROMPTS, 1: [100, 200, 300]}


def sampled_streams(be, sampling: dict[int, SamplingParams], steps: int, pick: bool) -> dict[int, list[int]]:
    """Each slot's tokens over `steps` batched steps, drawn by a Sampler of its params: through
    decode_batch_pick, or (pick False) on the host from decode_batch's full logits."""
    nxt = start(be, SAMPLED_PROMPTS)
    picks = {slot: Pick(Sampler(sampling[slot], 3000), History(list(prompt), len(prompt)))
             for slot, prompt in SAMPLED_PROMPTS.items()}
    out = {slot: [] for slot in nxt}
    for _ in range(steps):
        entries = list(nxt.items())
        if pick:
            tokens = [p.token for p in be.decode_batch_pick(entries, [picks[slot] for slot, _ in entries])]
        else:
            tokens = [picks[slot].sampler.sample(picks[slot].history, row)
                      for (slot, _), row in zip(entries, be.decode_batch(entries))]
        for (slot, _), token in zip(entries, tokens):
            picks[slot].sampler.accept(picks[slot].history, token)
            out[slot].append(token)
            nxt[slot] = token
    return out


@pytest.mark.parametrize("matmul", ["tiled", "rows"])
@pytest.mark.parametrize("last", ["open", "unreduced"])
def test_sampled_rows_give_the_tokens_of_their_full_logits(models, matmul, last, monkeypatch):
    """decode_batch_pick's sampled rows, reduced to candidates on the GPU, give the tokens the host's
    sampler draws from decode_batch's full logits, same seeds; a row whose candidates cannot decide
    (open top-p) reads its logits again, one that cannot be reduced (no truncation) reads them at once."""
    be = WebGPUBackend.load(open_model(models["Q8_0"]), RunOptions(n_ctx=80, prefill_chunk=8, slots=4, matmul=matmul))
    sampling = {**SAMPLED, 1: OPEN if last == "open" else UNREDUCED}
    want = sampled_streams(be, sampling, 12, pick=False)
    kinds, again = [], []
    pick_rows, copy_rows = be._pick_rows, be._copy_rows
    monkeypatch.setattr(be, "_pick_rows", lambda e, p, k, *rest: kinds.append(k) or pick_rows(e, p, k, *rest))
    monkeypatch.setattr(be, "_copy_rows", lambda enc, rows: again.append(list(rows)) or copy_rows(enc, rows))
    got = sampled_streams(be, sampling, 12, pick=True)
    assert got == want
    order = list(SAMPLED_PROMPTS)  # the rows' slots, in entry order
    assert all(k[order.index(s)] == ROW_CANDIDATES for k in kinds for s in SAMPLED)
    one = order.index(1)
    if last == "open":
        assert all(k[one] == ROW_CANDIDATES for k in kinds) and sum(one in rows for rows in again) >= 6
    else:
        assert all(k[one] == ROW_LOGITS for k in kinds)
    assert not any(set(rows) - {one} for rows in again if rows)  # every other row decided by its candidates


# every row decided by its candidates (a top-k, or greedy with penalties): steps chain on the GPU
CHAINED = {
    2: SAMPLED[2],
    0: SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=8, seed=6),
    3: SamplingParams(temperature=1.1, top_k=5, top_p=1.0, min_p=0.1, presence_penalty=0.4, frequency_penalty=0.3,
                      logit_bias={11: 2.0}, seed=7),
    1: SamplingParams(temperature=0.9, top_k=3, top_p=0.8, min_p=0.0, seed=8),
}


def test_sampled_batches_chain_on_the_gpu(models, monkeypatch):
    """Rows whose candidates always decide their token draw it on the GPU, and the next step runs
    the drawn tokens before the host has read them: the tokens are still those the host's sampler
    draws from decode_batch's full logits, and where the host's token is not the one drawn (forced
    here once) the step queued behind is not taken."""
    be = WebGPUBackend.load(open_model(models["Q8_0"]), RunOptions(n_ctx=80, prefill_chunk=8, slots=4, matmul="tiled"))
    want = sampled_streams(be, CHAINED, 12, pick=False)
    written = []
    dispatches = be.batch_dispatches
    monkeypatch.setattr(be, "batch_dispatches", lambda e, ids=True: written.append(ids) or dispatches(e, ids))
    assert sampled_streams(be, CHAINED, 12, pick=True) == want
    assert written.count(True) == 1 and written.count(False) == 12  # the last step queued one more
    parse, calls = cand.parse, []

    def drawn_otherwise(data, reduction, pending=None):
        found = parse(data, reduction, pending)
        calls.append(1)
        if len(calls) == 9 and found.drawn is not None:  # a step's third row: the GPU "drew" another token
            found = dataclasses.replace(found, drawn=found.drawn + 1)
        return found

    monkeypatch.setattr(cand, "parse", drawn_otherwise)
    written.clear()
    assert sampled_streams(be, CHAINED, 12, pick=True) == want
    assert written.count(True) == 2  # the first step, and the one after the token drawn otherwise


def test_a_damaged_row_fails_alone(nan_model_path):
    """argmax.wgsl flags a greedy row whose logits are not finite, candidates.wgsl a sampled one: each
    row's Picked carries the error that names the damage."""
    be = WebGPUBackend.load(open_model(nan_model_path), RunOptions(n_ctx=16, slots=2, matmul="tiled"))
    vocab = be.config.vocab_size
    for slot in (0, 1):
        be.select_slot(slot)
        be.forward([5, 6])
    picks = [Pick(Sampler(SamplingParams(temperature=0.0), vocab), History([5, 6], 2), greedy=True),
             Pick(Sampler(SamplingParams(temperature=0.8, seed=1), vocab), History([5, 6], 2))]
    rows = be.decode_batch_pick([(0, 7), (1, 8)], picks)
    for picked in rows:
        assert picked.token is None and isinstance(picked.error, NonFiniteError)
        assert "position 2 (for generated token 1)" in str(picked.error)


def test_a_damaged_greedy_batch_is_not_continued(nan_model_path, monkeypatch):
    """The step chained behind a batch whose argmax saw a non-finite logit is never taken, and the
    damage is reported from the damaged step's logits: the next step runs from the host's ids."""
    be = WebGPUBackend.load(open_model(nan_model_path), RunOptions(n_ctx=16, slots=2, matmul="tiled"))
    vocab = be.config.vocab_size
    for slot in (0, 1):
        be.select_slot(slot)
        be.forward([5, 6])
    picks = [Pick(Sampler(SamplingParams(temperature=0.0), vocab), History([5, 6], 2), greedy=True) for _ in range(2)]
    rows = be.decode_batch_pick([(0, 7), (1, 8)], picks)
    # the message counts the damaged step's own values: its logits were read after the step queued
    # behind it had overwritten them, so the step ran again for them
    for picked in rows:
        assert isinstance(picked.error, NonFiniteError) and "position 2 (for generated token 1)" in str(picked.error)
    assert be._chained is None and be.slot_past[:2] == [3, 3]
    written = []
    dispatches = be.batch_dispatches
    monkeypatch.setattr(be, "batch_dispatches", lambda e, ids=True: written.append(ids) or dispatches(e, ids))
    be.decode_batch_pick([(0, 7), (1, 8)], picks)
    assert written[0] is True


def test_a_batch_of_one_slot_is_a_decode_step(models):
    """With a single K/V cache, decode_batch continues the selected slot as forward does."""
    be = WebGPUBackend.load(open_model(models["Q4_K"]), RunOptions(n_ctx=16, slots=1, matmul="tiled"))
    want = alone(be, 0, [5, 6, 7], 2)
    be.reset()
    be.forward([5, 6])
    got = [be.decode_batch([(0, 7)])[0]]
    for _ in range(2):
        got.append(be.decode_batch([(0, int(np.argmax(got[-1])))])[0])
    assert be.n_past == 5
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_bad_batches_are_refused(models):
    be = WebGPUBackend.load(open_model(models["Q8_0"]), RunOptions(n_ctx=4, slots=2, matmul="tiled"))
    for entries, error in [([], "no tokens"), ([(2, 1)], "slot 2"), ([(0, 1), (0, 2)], "twice"),
                           ([(0, 3000)], "outside the vocabulary")]:
        with pytest.raises(ParameterError, match=error):
            be.decode_batch(entries)
    for backend in (be, ReferenceBackend.load(open_model(models["Q8_0"]), RunOptions(n_ctx=4, slots=2))):
        with pytest.raises(ParameterError, match="1 picks for a decode batch of 2 tokens"):
            backend.decode_batch_pick([(0, 1), (1, 2)], [greedy_pick(0)])
    be.forward([1, 2, 3, 4])
    with pytest.raises(ContextOverflowError):
        be.decode_batch([(1, 5), (0, 5)])
    assert be.slot_past[1] == 0 and be.n_past == 4  # nothing ran


def test_the_reference_backend_runs_a_batch_slot_by_slot(models):
    be = ReferenceBackend.load(open_model(models["Q8_0"]), RunOptions(n_ctx=32, slots=2))
    be.select_slot(1)
    want = [be.forward([5, 6])]
    be.reset()
    be.forward([5])
    be.select_slot(0)
    be.forward([9])
    got = be.decode_batch([(1, 6), (0, 10)])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    be.select_slot(0)
    be.reset()
    np.testing.assert_allclose(got[1], be.forward([9, 10]), rtol=1e-5, atol=1e-5)
    assert be.slot == 0


def test_a_batch_past_gemv_tokens_runs_through_gemm(models):
    """More decode tokens than gemv.wgsl takes (GEMV_TOKENS) run through gemm.wgsl and its K-splits,
    whose QKV sums stay dispatches of their own in decode (a chunk's rope.wgsl sums them, and decode
    has none): each row's logits are the ones its slot gets alone, within gemm.wgsl's f16 bound."""
    slots = 10
    be = WebGPUBackend.load(open_model(models["Q8_0"]), RunOptions(n_ctx=32, slots=slots, matmul="tiled"))
    assert slots > be.pipes.gemv_tokens and be.group_slots == slots
    assert any(op.shader == "split_sum" and op.phase == "decode" for op in be.slot_ops[0][0].ops)
    prompts = {s: [s + 1, 2 * s + 7, 100 + s, 40 + 3 * s] for s in range(slots)}
    want = {s: alone(be, s, prompt, 0)[0] for s, prompt in prompts.items()}
    for s, prompt in prompts.items():
        be.select_slot(s)
        be.reset()
        be.forward(prompt[:-1])
    got = be.decode_batch([(s, prompt[-1]) for s, prompt in prompts.items()])
    for s in prompts:
        np.testing.assert_allclose(got[s], want[s], atol=1e-2 * max(1.0, np.abs(want[s]).max()))
