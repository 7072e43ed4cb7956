"""The prompt cache: a request keeps the K/V of the prefix it shares with what ran before and
prefills only the rest.

Logits after a kept prefix are compared with a fresh prefill on the numpy reference (rtol 1e-5:
numpy's matmuls may sum a row differently in a batch of another size) and on WebGPU (tiny
synthetic models, 2e-3 of the largest logit; the real SmolLM2: same top-1 and 2e-2), for a prefix
ending inside a prefill chunk, on a chunk boundary and past a sliding window (a synthetic Gemma 3
with an 8-token window). Greedy and seeded sampled answers over a scripted conversation, with a
prompt that shares nothing, a shorter prompt and an edited earlier turn, are the same bytes with
the cache as without it, on both backends (the greedy one chained on the GPU with WebGPU).
"""

import numpy as np
import pytest

from airframe.engine import Engine, Finish, GenerationParams
from airframe.errors import ParameterError, UnsupportedError
from airframe.model import open_model
from airframe.options import RunOptions
from airframe.prompt_cache import PromptCache, PromptSlots, common_prefix
from airframe.reference import ReferenceBackend
from airframe.sampling import SamplingParams
from airframe.synthetic import write_synthetic_gguf

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, seed=5)
CHUNK = 8  # prefill chunk of the synthetic engines: short prompts cross chunk boundaries
PROMPT = [7, 300, 400, 12, 9, 204, 77, 5, 1, 99, 3, 432, 18, 250, 61, 8, 140, 33, 2, 470, 15, 16]  # 22 ids
OTHER = PROMPT[:17] + [41, 42, 43, 44, 45, 46, 47, 48, 49]  # shares 17 ids; the stale K/V after differ


# ---- the record ---------------------------------------------------------------------------------
def test_common_prefix_and_what_a_prompt_may_keep():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2]) == 2
    cache = PromptCache()
    assert cache.reusable([1, 2, 3]) == 0
    cache.remember([1, 2, 3, 4, 5], n_past=4)  # the last generated token never ran
    assert cache.tokens == [1, 2, 3, 4]
    assert cache.reusable([1, 2, 3, 4, 9]) == 4
    assert cache.reusable([1, 2, 3]) == 2  # the whole prompt is cached: its last token runs again
    assert cache.reusable([9, 2, 3]) == 0
    cache.remember([1, 2], n_past=5)  # the device ran ids the engine never took: only known ones
    assert cache.tokens == [1, 2]
    cache.forget()
    assert cache.reusable([1, 2, 3]) == 0


# ---- logits after a kept prefix -------------------------------------------------------------------
def after_kept_prefix(be, before: list[int], prompt: list[int], keep: int) -> np.ndarray:
    """`before` runs, its first `keep` positions are kept and the rest of `prompt` runs after them."""
    assert before[:keep] == prompt[:keep]
    be.reset()
    be.forward(before)
    be.keep_prefix(keep)
    return be.forward(prompt[keep:])


def fresh(be, prompt: list[int]) -> np.ndarray:
    be.reset()
    return be.forward(prompt)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("llama") / "tiny.gguf", "llama", "tiny", "Q8_0")


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory):
    """Gemma 3's switches, 6 layers (5 with an 8-token sliding window, one global)."""
    shape = {"n_layers": 6, "sliding_window": 8}
    return write_synthetic_gguf(tmp_path_factory.mktemp("gemma3") / "tiny.gguf", "gemma3", shape, "Q8_0")


def load(path, backend: str, **options):
    return Engine.load(path, backend=backend, options=RunOptions(n_ctx=256, prefill_chunk=CHUNK, **options))


def close(got, want, tolerance):
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("keep", [5, CHUNK, 2 * CHUNK, 13], ids=["inside-chunk", "on-chunk", "two-chunks", "past-window"])
@pytest.mark.parametrize("backend, tolerance", [("reference", 1e-5), ("webgpu", 2e-3)])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_logits_after_a_kept_prefix_equal_a_fresh_prefill(family, backend, tolerance, keep, request):
    be = load(request.getfixturevalue(f"{family}_path"), backend).backend
    want = fresh(be, PROMPT)
    got = after_kept_prefix(be, OTHER, PROMPT, keep)
    close(got, want, tolerance)
    assert int(np.argmax(got)) == int(np.argmax(want))
    if family == "gemma3":
        assert be.config.sliding_window == 8 and be.config.is_local_layer(0)  # keeps of 13 and 16 pass it


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_real_models_on_webgpu_give_the_same_top_1_after_a_kept_prefix(model):
    engine = Engine.load(model, backend="webgpu", options=RunOptions(n_ctx=128, prefill_chunk=16))
    be = engine.backend
    prompt = engine.tokenize_prompt("The three primary colours are red, yellow and blue. Mixing red and yellow "
                                    "gives orange, and mixing yellow and blue gives")
    before = prompt[:20] + engine.tokenize_prompt(" an unrelated ending of the first request")[1:]
    want = fresh(be, prompt)
    for keep in (16, 20):  # on the chunk boundary, inside the second chunk
        got = after_kept_prefix(be, before, prompt, keep)
        assert int(np.argmax(got)) == int(np.argmax(want))
        close(got, want, 2e-2)


def test_keep_prefix_checks_what_it_is_asked():
    be = ReferenceBackend.load(open_model("smollm2-135m"), RunOptions(n_ctx=16))
    be.forward([1, 2, 3])
    with pytest.raises(ParameterError, match=r"keep_prefix\(4\) with 3 positions in the cache, expected 0..3"):
        be.keep_prefix(4)
    be.keep_prefix(2)
    assert be.n_past == 2
    be.keeps_prompt_cache = False
    with pytest.raises(UnsupportedError, match="does not keep its cache across requests"):
        be.keep_prefix(1)
    be.keep_prefix(0)
    assert be.n_past == 0


# ---- whole answers, with the cache and without -----------------------------------------------------
TURNS = ["Hello! Who are you?", "Tell me about rivers.", "And mountains?", "Which is higher?"]


def conversations() -> list[list[dict] | str]:
    """A scripted chat growing turn by turn (each answer a fixed text), then a shorter prompt than the
    cached one, an edited earlier turn and a raw prompt that shares nothing."""
    prompts, messages = [], []
    for i, turn in enumerate(TURNS):
        messages = messages + [{"role": "user", "content": turn}]
        prompts.append(messages)
        messages = messages + [{"role": "assistant", "content": f"Answer number {i}."}]
    prompts.append(prompts[1])  # shorter than what ran last
    prompts.append([{"role": "user", "content": "Hello! Who are YOU?"}] + prompts[3][1:])  # turn 1 edited
    prompts.append("Zebra crossing")
    return prompts


def run_all(engine: Engine, sampling: SamplingParams) -> tuple[list[str], list[Finish]]:
    texts, finishes = [], []
    for prompt in conversations():
        text, finish, _ = engine.generate(prompt, GenerationParams(max_tokens=6, sampling=sampling))
        texts.append(text)
        finishes.append(finish)
    return texts, finishes


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("backend", ["reference", "webgpu"])
def test_answers_with_the_cache_are_the_bytes_of_answers_without_it(llama_path, backend, sampling):
    cached = load(llama_path, backend)
    plain = load(llama_path, backend, prompt_cache=False)
    if backend == "webgpu" and sampling is GREEDY:
        assert cached._greedy_on_device(GenerationParams(sampling=sampling))  # greedy.py's keep
    texts, finishes = run_all(cached, sampling)
    want, plain_finishes = run_all(plain, sampling)
    assert [t.encode() for t in texts] == [t.encode() for t in want]
    assert all(f.cached_tokens == 0 for f in plain_finishes)
    kept = [f.cached_tokens for f in finishes]
    assert kept[0] == 0 and all(k > 0 for k in kept[1:4])  # each turn keeps the conversation so far
    assert kept[1] >= finishes[0].prompt_tokens  # ... the first answer's tokens that ran included
    assert kept[4] < finishes[4].prompt_tokens  # shorter: its last token runs again
    prompts = [cached.tokenize_prompt(p) for p in conversations()]
    assert kept[5] == common_prefix(prompts[5], prompts[4]) < len(prompts[4]) - 1  # up to the edit in turn 1
    assert kept[6] <= 1  # nothing shared but BOS, if the tokenizer adds one
    assert [(f.reason, f.prompt_tokens, f.completion_tokens) for f in finishes] == \
        [(f.reason, f.prompt_tokens, f.completion_tokens) for f in plain_finishes]


def test_a_request_can_opt_out_and_an_abandoned_stream_keeps_nothing(llama_path):
    engine = load(llama_path, "reference", slots=1)  # one record: the opted-out run is not kept elsewhere
    params = GenerationParams(max_tokens=3, sampling=GREEDY)
    engine.generate("The same words again", params)
    assert engine.generate("The same words again", params)[1].cached_tokens > 0
    opted_out = GenerationParams(max_tokens=3, sampling=GREEDY, cache_prompt=False)
    assert engine.generate("The same words again", opted_out)[1].cached_tokens == 0
    stream = engine.stream("The same words again", params)
    next(stream)
    stream.close()  # the answer was dropped midway
    assert engine.generate("The same words again", params)[1].cached_tokens == 0
    with pytest.raises(ParameterError, match="cache_prompt = 'no', expected True or False"):
        engine.stream("x", GenerationParams(cache_prompt="no"))


def test_a_backend_reset_behind_the_engine_is_not_trusted(llama_path):
    engine = load(llama_path, "reference")
    params = GenerationParams(max_tokens=2, sampling=GREEDY)
    engine.generate("Some words to keep", params)
    engine.backend.reset()
    assert engine.generate("Some words to keep", params)[1].cached_tokens == 0


# ---- several slots --------------------------------------------------------------------------------
def test_a_request_goes_to_the_slot_sharing_most_else_the_least_recently_used():
    slots = PromptSlots(3)
    assert slots.choose([1, 2, 3]) == 0  # all empty and unused: the first
    slots.use(0).remember([1, 2, 3, 4], n_past=4)
    slots.use(1).remember([1, 2, 3, 9], n_past=4)
    assert slots.choose([1, 2, 3, 4, 5]) == 0  # shares 4 with slot 0, 3 with slot 1
    assert slots.choose([1, 2, 3, 9, 5]) == 1
    assert slots.choose([7, 7]) == 2  # shares nothing: the least recently used (never used)
    slots.use(2).remember([7, 7, 7], n_past=3)
    assert slots.choose([5, 5]) == 0  # nothing shared: slot 0 ran longest ago
    assert slots.choose([1, 2, 3, 5]) == 0  # slots 0 and 1 share 3 each: the less recently used
    assert slots.choose([1, 2, 5, 5]) == 0  # 2 of 4 cached ids is not more than half: by age
    slots.use(0)
    assert slots.choose([1, 2, 5, 5]) == 1
    assert slots.choose([7, 7, 7, 1]) == 2 and slots.choose([7, 7, 7, 1], reuse=False) == 1  # opted out: by age


def two_conversations() -> list[tuple[str, list[dict]]]:
    """Two scripted chats whose turns alternate, each with its own system prompt: (which chat, its
    messages so far)."""
    scripts = {"a": TURNS[:3], "b": ["Write me a poem about the sea.", "Shorter, please.", "Now about a lake."]}
    asked, messages = [], {name: [{"role": "system", "content": f"You are assistant {name}."}] for name in scripts}
    for i in range(3):
        for name, turns in scripts.items():
            messages[name] = messages[name] + [{"role": "user", "content": turns[i]}]
            asked.append((name, messages[name]))
            messages[name] = messages[name] + [{"role": "assistant", "content": f"{name} said {i}."}]
    return asked


@pytest.mark.parametrize("backend", ["reference", "webgpu"])
def test_two_interleaved_conversations_over_two_slots_keep_both_warm(llama_path, backend):
    cached = load(llama_path, backend, slots=2)
    plain = load(llama_path, backend, prompt_cache=False)
    assert (cached.backend.n_slots, plain.backend.n_slots) == (2, 1)
    params = GenerationParams(max_tokens=6, sampling=GREEDY)
    got = [cached.generate(messages, params) for _, messages in two_conversations()]
    want = [plain.generate(messages, params) for _, messages in two_conversations()]
    assert [text.encode() for text, _, _ in got] == [text.encode() for text, _, _ in want]
    kept = [finish.cached_tokens for _, finish, _ in got]
    assert kept[0] == 0 and kept[1] < got[0][1].prompt_tokens // 2  # b's first turn shares only the markup
    for i in range(2, len(kept)):  # every later turn keeps its own conversation's previous prompt and answer
        assert kept[i] >= got[i - 2][1].prompt_tokens, (i, kept)
    assert [f.cached_tokens for _, f, _ in want] == [0] * len(want)


def test_a_third_conversation_evicts_the_least_recently_used_slot(llama_path):
    engine = load(llama_path, "reference", slots=2)
    params = GenerationParams(max_tokens=3, sampling=GREEDY)
    prompts = {"a": "Rivers run to the sea and", "b": "Mountains rise above the clouds and", "c": "Zebras graze on"}
    kept = {}
    for name in ("a", "b", "c", "b", "a"):
        finish = engine.generate(prompts[name], params)[1]
        kept.setdefault(name, []).append(finish.cached_tokens)
    n_bos = common_prefix(engine.tokenize_prompt(prompts["a"]), engine.tokenize_prompt(prompts["c"]))
    assert kept["c"] == [n_bos]  # c went to a's slot, the least recently used
    assert kept["b"][1] == len(engine.tokenize_prompt(prompts["b"])) - 1  # b's slot was kept
    assert kept["a"][1] == n_bos  # a was evicted by c: only what it shares with c is reused
    assert engine.slots.caches[engine.backend.slot].tokens[:len(engine.tokenize_prompt(prompts["a"]))] == \
        engine.tokenize_prompt(prompts["a"])


def test_slots_are_allocated_once_and_switch_the_cache(llama_path):
    be = load(llama_path, "reference", slots=2).backend
    be.reset()
    be.forward(PROMPT)
    be.select_slot(1)
    assert be.n_past == 0  # slot 1's own cache, empty
    be.forward(OTHER[:5])
    be.select_slot(0)
    assert be.n_past == len(PROMPT)
    close(be.forward([PROMPT[-1]]), after_kept_prefix(be, PROMPT, PROMPT + [PROMPT[-1]], len(PROMPT)), 1e-5)
    with pytest.raises(ParameterError, match=r"slot 2, expected 0..1 \(the reference backend holds 2 K/V caches\)"):
        be.select_slot(2)
