"""Tool calling against a running `airframe serve`, through the official `openai` client: the
weather tool asked about one city with tool_choice auto, whole and streamed; the call and the
tool's answer sent back; and the model's raw text for the same prompt (a /v1/completions request
on the prompt the template renders), so that one sees which format the model wrote.

    airframe serve qwen2.5-coder-0.5b --ctx 1024 &
    python dev/tool_call_check.py --base http://127.0.0.1:8080/v1 --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
import time

import openai

from airframe.engine import prompt_parts
from airframe.model import open_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
ANSWER = json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21})


def _timed(label: str, make):
    started = time.perf_counter()
    result = make()
    print(f"{label}: {time.perf_counter() - started:.0f} s")
    return result


def _streamed(api, model: str, max_tokens: int) -> dict:
    calls, reason, content = {}, None, ""
    for chunk in api.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], temperature=0,
                                             max_tokens=max_tokens, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return {"content": content, "calls": calls, "finish_reason": reason}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--model", required=True, help="the served model (a name or the GGUF path, for its template)")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    api = openai.OpenAI(base_url=args.base, api_key="none", max_retries=0, timeout=3600)

    _, template = prompt_parts(open_model(args.model))
    prompt = template.render(ASK, tools=[WEATHER])
    raw = _timed("raw text", lambda: api.completions.create(model=args.model, prompt=prompt, temperature=0,
                                                            max_tokens=args.max_tokens))
    print("  raw:", json.dumps(raw.choices[0].text), raw.usage.completion_tokens, "tokens")

    answer = _timed("whole", lambda: api.chat.completions.create(model=args.model, messages=ASK, tools=[WEATHER],
                                                                 temperature=0, max_tokens=args.max_tokens))
    message = answer.choices[0].message
    print("  finish_reason:", answer.choices[0].finish_reason, "content:", json.dumps(message.content))
    for call in message.tool_calls or []:
        print("  call:", call.id, call.function.name, call.function.arguments, json.loads(call.function.arguments))
    if message.tool_calls:
        call = message.tool_calls[0]
        back = ASK + [message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": ANSWER}]
        after = _timed("sent back", lambda: api.chat.completions.create(model=args.model, messages=back, tools=[WEATHER],
                                                                        temperature=0, max_tokens=16))
        print("  answer:", json.dumps(after.choices[0].message.content), after.choices[0].finish_reason,
              after.usage.prompt_tokens, "prompt tokens",
              [(c.function.name, c.function.arguments) for c in after.choices[0].message.tool_calls or []])

    print("  streamed:", _timed("streamed", lambda: _streamed(api, args.model, args.max_tokens)))


if __name__ == "__main__":
    main()
