"""Time to first token of a conversation's second turn with the prompt cache, through the server.

An in-process server (the FastAPI app under TestClient, the official `openai` client) serves a
model on WebGPU; the first turn's prompt has about --history tokens, the second turn resends it
with the answer and a short question. Prints both turns' prompt and cached tokens and their time
to the first streamed token, and checks the second turn against issue #25's bar: cached_tokens >=
history - 10 and a time to first token under a third of the first turn's.

    python dev/webgpu/prompt_cache_ttft.py [--model smollm2-135m] [--history 1000]
"""

from __future__ import annotations

import argparse
import time

import openai
from fastapi.testclient import TestClient

from airframe.engine import Engine
from airframe.options import RunOptions
from airframe.server import create_app

PARAGRAPH = ("The river rises in the hills above the town, runs through the old mill race and the water "
             "meadows, turns south past the church and reaches the sea after forty miles of farmland. ")


def turn(api: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, float, object]:
    """One streamed greedy answer: its text, the seconds to its first content chunk, its usage."""
    started = time.perf_counter()
    first, text, usage = None, [], None
    stream = api.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0.0,
                                         stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return "".join(text), (first or time.perf_counter()) - started, usage


def history(engine: Engine, n_tokens: int) -> list[dict]:
    """A first-turn chat whose prompt has about n_tokens tokens."""
    words = ""
    while True:
        messages = [{"role": "user", "content": words + "Summarise the text above in one sentence."}]
        if len(engine.tokenize_prompt(messages)) >= n_tokens:
            return messages
        words += PARAGRAPH


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--history", type=int, default=1000, help="prompt tokens of the first turn (about)")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    engine = Engine.load(args.model, backend="webgpu", options=RunOptions(n_ctx=2 * args.history + 512))
    messages = history(engine, args.history)
    with TestClient(create_app(engine)) as client:
        api = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="none", http_client=client, max_retries=0)
        answer, first_ttft, first = turn(api, messages, args.max_tokens)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Shorter, please."}]
        _, second_ttft, second = turn(api, messages, args.max_tokens)
    for name, ttft, usage in (("first turn", first_ttft, first), ("second turn", second_ttft, second)):
        print(f"{name:<12} prompt {usage.prompt_tokens:>5} tokens, cached {usage.prompt_tokens_details.cached_tokens:>5}, "
              f"time to first token {ttft:.2f} s")
    cached = second.prompt_tokens_details.cached_tokens
    ok = cached >= first.prompt_tokens - 10 and second_ttft < first_ttft / 3
    print(f"second/first time to first token {second_ttft / first_ttft:.3f}; "
          f"{'meets' if ok else 'misses'} the bar (cached >= {first.prompt_tokens - 10}, ratio < 0.333)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
