"""`airframe run MODEL "prompt"`: stream one answer to the terminal, then a speed line on stderr.

The generation flags, their checks and the speed line are shared with `airframe chat`. Every flag
is checked before the model loads, and an error names the flag as typed (`-n`, `--temp`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from contextlib import contextmanager

from ..backend import BACKENDS, DEFAULT_BACKEND
from ..errors import ContextOverflowError, ParameterError
from ..sampling import SamplingParams
from ._load import add_load_arguments
from ._rope import add_rope_arguments, rope_options

HELP = "generate text from a prompt, streamed to the terminal"
# the flag that sets each field a ParameterError may name (SamplingParams, RunOptions)
FLAGS = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
         "repeat_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n", "seed": "--seed",
         "n_ctx": "--ctx"}
UNTIL_FULL = "or -1 (until the context is full)"
DEFAULT_MAX_TOKENS = 256


def add_generation_arguments(p) -> None:
    defaults = SamplingParams()
    p.add_argument("model", metavar="MODEL", help="a GGUF path or a known model name")
    p.add_argument("-n", "--max-tokens", type=int, default=None, metavar="N",
                   help=f"most tokens to generate (default {DEFAULT_MAX_TOKENS} or the context's size if smaller; "
                        f"-1 = until the context is full)")
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
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="the answer is JSON this schema (a JSON file) allows")
    constraint.add_argument("--grammar", metavar="FILE", help="the answer keeps to this GBNF or Lark grammar")


@contextmanager
def in_flag_words():
    """A ParameterError about a field ("top_p = 7.0, expected ...") names its flag instead ("--top-p = 7.0")."""
    try:
        yield
    except ParameterError as e:
        field, equals, rest = str(e).partition(" = ")
        if not equals or field not in FLAGS:
            raise
        raise type(e)(f"{FLAGS[field]} = {rest}") from None


def read_flags(args):
    """The GenerationParams and RunOptions the flags ask for; ParameterError naming the flag, before
    any file is read."""
    from ..engine import GenerationParams
    from ..options import RunOptions

    with in_flag_words():
        options = RunOptions.from_env(n_ctx=args.ctx, progress=True, check_tensors=getattr(args, "check_tensors", False))
        sampling = SamplingParams(
            temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed)
    n = args.max_tokens
    if n is not None and n < -1:
        raise ParameterError(f"-n = {n}, expected an integer >= 0, {UNTIL_FULL}")
    if n is not None and args.ctx is not None and n > args.ctx:
        raise ParameterError(f"-n = {n}, expected at most --ctx ({args.ctx}), {UNTIL_FULL}")
    max_tokens = DEFAULT_MAX_TOKENS if n is None else None if n == -1 else n
    return GenerationParams(max_tokens=max_tokens, sampling=sampling, stop=list(args.stop),
                            grammar=read_grammar(args)), options


def read_grammar(args):
    """The Grammar that --json-schema or --grammar names (None: neither); ParameterError naming the flag."""
    from ..constraint import json_schema_grammar, text_grammar

    for flag, path, make in (("--json-schema", getattr(args, "json_schema", None), json_schema_grammar),
                             ("--grammar", getattr(args, "grammar", None), text_grammar)):
        if path is None:
            continue
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ParameterError(f"{flag} {path}: cannot be read ({e}), expected a UTF-8 text file") from None
        try:
            return make(text)
        except ParameterError as e:
            raise ParameterError(f"{flag} {path}: {e}") from None
    return None


@contextmanager
def in_context_words():
    """A prompt too long for the context says what would help, in the command line's terms."""
    try:
        yield
    except ContextOverflowError as e:
        raise ContextOverflowError(f"{e}; shorten the prompt or raise --ctx") from None


def load_engine(args, params, options, chat: bool, prompt: str | list[dict] | None = None):
    """Check the flags against the model's file (its context, its chat template) and, with --ctx,
    that `prompt` fits, then load the model. Without -n, params.max_tokens is cut to the context."""
    from ..engine import Engine, check_fits, encode_prompt, prompt_parts
    from ..model import open_model

    model = open_model(args.model, **rope_options(args))
    trained = model.config.ctx_train  # the default context is never longer (--ctx was checked above)
    asked = args.max_tokens is not None and params.max_tokens is not None
    if asked and args.ctx is None and params.max_tokens > trained:
        raise ParameterError(f"-n = {params.max_tokens}, expected at most the {trained} tokens the model was "
                             f"trained on (a longer context needs --ctx), {UNTIL_FULL}")
    if chat:
        warn_without_template(model)
    parts = prompt_parts(model)
    if prompt is not None and args.ctx is not None and args.backend != "cuda":  # cuda's context is its plan's
        with in_context_words():
            check_fits(len(encode_prompt(*parts, prompt)), args.ctx)
    engine = Engine.load(model, backend=args.backend, options=options, parts=parts)
    if asked and params.max_tokens > engine.n_ctx:
        raise ParameterError(f"-n = {params.max_tokens}, expected at most the context's {engine.n_ctx} tokens "
                             f"(--ctx), {UNTIL_FULL}")
    if params.max_tokens is not None:
        params.max_tokens = min(params.max_tokens, engine.n_ctx)
    return engine


def warn_without_template(model) -> None:
    """A file without a chat template is most likely a base model: it continues text, and chat
    answers through the built-in turn format are poor. Said, not refused: the format is the family's
    own, and a fine-tune whose file lost its template still answers through it."""
    from ..chat_template import FAMILY_TEMPLATES

    source = model.gguf.get("tokenizer.chat_template")
    if isinstance(source, str) and source.strip():
        return
    family = model.config.family
    fallback = f"the built-in {family} turn format" if family in FAMILY_TEMPLATES else "ChatML"
    print(f"airframe: warning: {model.path.name} has no chat template (tokenizer.chat_template), so it is "
          f"most likely a base model, which continues text instead of answering; chatting through "
          f"{fallback}, expect poor answers (`airframe run` without --chat continues a prompt as text)",
          file=sys.stderr, flush=True)


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
    prefill = (finish.prompt_tokens - finish.cached_tokens) / finish.prefill_seconds  # the tokens that ran
    line = (f"[{finish.reason}] prompt {finish.prompt_tokens} tokens, prefill {prefill:.1f} tokens/s, "
            f"{finish.completion_tokens} generated")
    decoded = finish.completion_tokens - 1
    if decoded >= 1 and finish.decode_seconds > 0:
        ms = 1000 * finish.decode_seconds / decoded
        line += f", decode {decoded / finish.decode_seconds:.1f} tokens/s ({ms:.1f} ms/token)"
    if finish.cached_tokens:
        line += f"; {finish.cached_tokens} prompt tokens from the prompt cache"
    return line


def stream_to(out, engine, prompt, params, cancel=None, echo: str = ""):
    """Print `echo`, then every piece as it comes; return (the whole text, the Finish).

    A prompt that does not fit is refused before anything is printed. Whatever stops the answer
    midway (an error, Ctrl-C) first ends the line, so its message starts a line of its own.
    """
    from ..engine import Finish

    with in_context_words():
        items = engine.stream(prompt, params, cancel)
    texts = []
    out.write(echo)
    out.flush()
    try:
        for item in items:
            if isinstance(item, Finish):
                return "".join(texts), item
            texts.append(item.text)
            out.write(item.text)
            out.flush()
    except BaseException:
        if not (echo + "".join(texts)).endswith("\n") and (echo or any(texts)):
            out.write("\n")
            out.flush()
        raise
    raise AssertionError("stream ended without a Finish")


def run(args) -> int:
    params, options = read_flags(args)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    engine = load_engine(args, params, options, chat=args.chat, prompt=prompt)
    _, finish = stream_to(sys.stdout, engine, prompt, params, echo="" if args.chat else args.prompt)
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(speed_line(finish), file=sys.stderr)
    return 0
