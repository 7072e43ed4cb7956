"""`airframe run MODEL "prompt"`: stream one answer to the terminal, then a speed line on stderr.

The generation flags and the speed line are shared with `airframe chat`.
"""

from __future__ import annotations

import sys

from ..backend import BACKENDS, DEFAULT_BACKEND
from ..sampling import SamplingParams
from ._load import add_load_arguments
from ._rope import add_rope_arguments, rope_options

HELP = "generate text from a prompt, streamed to the terminal"


def add_generation_arguments(p) -> None:
    defaults = SamplingParams()
    p.add_argument("model", metavar="MODEL", help="a GGUF path or a known model name")
    p.add_argument("-n", "--max-tokens", type=int, default=256, metavar="N",
                   help="most tokens to generate (default 256; -1 = until the context is full)")
    p.add_argument("--temp", type=float, default=defaults.temperature, metavar="T",
                   help=f"temperature, 0 = greedy (default {defaults.temperature})")
    p.add_argument("--top-k", type=int, default=defaults.top_k, metavar="K", help=f"0 = off (default {defaults.top_k})")
    p.add_argument("--top-p", type=float, default=defaults.top_p, metavar="P", help=f"1.0 = off (default {defaults.top_p})")
    p.add_argument("--min-p", type=float, default=defaults.min_p, metavar="P", help=f"0.0 = off (default {defaults.min_p})")
    p.add_argument("--repeat-penalty", type=float, default=defaults.repeat_penalty, metavar="R",
                   help=f"1.0 = off (default {defaults.repeat_penalty})")
    p.add_argument("--repeat-last-n", type=int, default=defaults.repeat_last_n, metavar="N",
                   help=f"tokens the repeat penalty looks back over, -1 = all (default {defaults.repeat_last_n})")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="makes sampling reproducible")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when this text appears (repeat the flag for several)")
    p.add_argument("--ctx", type=int, default=None, metavar="N", help="context size in tokens (default: the backend's)")
    p.add_argument("--backend", choices=BACKENDS, default=DEFAULT_BACKEND, help=f"default {DEFAULT_BACKEND}")
    add_rope_arguments(p)
    add_load_arguments(p)


def add_arguments(p) -> None:
    add_generation_arguments(p)
    p.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")


def generation_params(args):
    from ..engine import GenerationParams

    sampling = SamplingParams(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed)
    max_tokens = None if args.max_tokens == -1 else args.max_tokens
    return GenerationParams(max_tokens=max_tokens, sampling=sampling, stop=list(args.stop))


def load_engine(args):
    from ..engine import Engine
    from ..options import RunOptions

    options = RunOptions.from_env(n_ctx=args.ctx, progress=True, check_tensors=args.check_tensors)
    return Engine.load(args.model, backend=args.backend, options=options, **rope_options(args))


def speed_line(finish) -> str:
    """Prefill runs until the first token is chosen; decode covers every token after it. A backend
    that runs the prompt in the same launches as the answer (the CUDA megakernel) times them
    together (prefill_seconds 0): the line then gives the rate of those steps, prompt included."""
    if finish.prefill_seconds <= 0:
        line = f"[{finish.reason}] prompt {finish.prompt_tokens} tokens, {finish.completion_tokens} generated"
        steps = finish.prompt_tokens + finish.completion_tokens - 1  # (the last token is chosen, not run)
        if steps < 1 or finish.decode_seconds <= 0:
            return line
        ms = 1000 * finish.decode_seconds / steps
        return line + (f", {steps / finish.decode_seconds:.1f} tokens/s over prompt and answer together "
                       f"({ms:.1f} ms/token)")
    prefill = finish.prompt_tokens / finish.prefill_seconds
    line = (f"[{finish.reason}] prompt {finish.prompt_tokens} tokens, prefill {prefill:.1f} tokens/s, "
            f"{finish.completion_tokens} generated")
    decoded = finish.completion_tokens - 1
    if decoded < 1 or finish.decode_seconds <= 0:
        return line
    ms = 1000 * finish.decode_seconds / decoded
    return line + f", decode {decoded / finish.decode_seconds:.1f} tokens/s ({ms:.1f} ms/token)"


def stream_to(out, engine, prompt, params, cancel=None):
    """Print every piece as it comes; return (the whole text, the Finish)."""
    from ..engine import Finish

    texts = []
    for item in engine.stream(prompt, params, cancel):
        if isinstance(item, Finish):
            return "".join(texts), item
        texts.append(item.text)
        out.write(item.text)
        out.flush()
    raise AssertionError("stream ended without a Finish")


def run(args) -> int:
    params = generation_params(args)
    engine = load_engine(args)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    if not args.chat:
        sys.stdout.write(args.prompt)
    _, finish = stream_to(sys.stdout, engine, prompt, params)
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(speed_line(finish), file=sys.stderr)
    return 0
