"""`airframe chat MODEL`: an interactive conversation with history.

Each answer streams as it is generated and is followed by a speed line on stderr. Each turn
prefills only what is new: the engine keeps the conversation's K/V (airframe/prompt_cache.py). `/reset`
forgets the conversation, `/exit` (or end of input, Ctrl-D) leaves. Ctrl-C during an answer
stops that answer and keeps the conversation as it was before the question.
"""

from __future__ import annotations

import sys

from ..errors import AirframeError
from .run import add_generation_arguments, load_engine, read_flags, speed_line, stream_to

HELP = "chat with a model in the terminal (/reset starts over, /exit leaves)"
PROMPT = "> "


def add_arguments(p) -> None:
    add_generation_arguments(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message to start every conversation")


def run(args) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    params, options = read_flags(args)
    engine = load_engine(args, params, options, chat=True)
    first = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(first)
    print(f"chatting with {engine.model_id} ({engine.backend.name} backend); /reset starts over, /exit leaves",
          file=sys.stderr)
    while True:
        line = _read_line()
        if line is None or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = list(first)
            print("(conversation reset)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        asked = messages + [{"role": "user", "content": line}]
        try:
            answer, finish = stream_to(sys.stdout, engine, asked, params)
        except KeyboardInterrupt:
            print("(answer interrupted)", file=sys.stderr)
            continue
        except AirframeError as e:  # e.g. the conversation outgrew the context: /reset helps
            print(f"airframe: error: {e}", file=sys.stderr)
            continue
        print()
        print(speed_line(finish), file=sys.stderr)
        messages = asked + [{"role": "assistant", "content": answer}]


def _read_line() -> str | None:
    try:
        return input(PROMPT)
    except (EOFError, KeyboardInterrupt):
        print(file=sys.stderr)
        return None
