from pathlib import Path

from ..backend import BACKENDS, DEFAULT_BACKEND, open_backend
from ..errors import ParameterError
from ..model import open_model
from ..options import RunOptions
from ..perplexity import MIN_CTX, cut_windows, perplexity
from ._load import add_load_arguments
from ._rope import add_rope_arguments, rope_options

HELP = "perplexity of a model on a text file, scored like llama.cpp's llama-perplexity"
DESCRIPTION = """\
Perplexity of MODEL on the text of --file, scored like llama.cpp's llama-perplexity: the text is
tokenised once (with BOS when the model adds one) and cut into non-overlapping windows of --ctx
tokens (the tail that does not fill a window is dropped; at least two windows are needed). Each
window runs from an empty cache with its first token replaced by BOS (when the model adds BOS);
its first ctx/2 tokens are context only and the tokens after them are scored, ctx - ctx/2 - 1 per
window. PPL = exp(mean negative log-likelihood); the +/- is one standard error, as llama.cpp
prints it.
"""


def add_arguments(p):
    p.description = DESCRIPTION
    p.add_argument("model", metavar="MODEL", help="a GGUF path or a known model name")
    p.add_argument("--file", "-f", required=True, type=Path, help="UTF-8 text to score")
    p.add_argument("--ctx", type=int, default=512, help="window size in tokens (default 512, as llama.cpp)")
    p.add_argument("--backend", choices=BACKENDS, default=DEFAULT_BACKEND, help=f"default {DEFAULT_BACKEND}")
    add_rope_arguments(p)
    add_load_arguments(p)
    p.add_argument("--chunks", type=int, default=None, help="score only the first N windows")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ParameterError(f"--file {path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ParameterError(f"--file {path}: byte {e.start} is not UTF-8, expected UTF-8 text") from None


def run(args) -> int:
    from ..tokenizer import load_tokenizer

    if args.chunks is not None and args.chunks < 2:
        raise ParameterError(f"--chunks = {args.chunks}, expected an integer >= 2")
    if args.ctx < MIN_CTX:
        raise ParameterError(f"--ctx = {args.ctx}, expected an integer >= {MIN_CTX}")
    options = RunOptions.from_env(n_ctx=args.ctx, progress=not args.quiet, check_tensors=args.check_tensors)
    text = _read_text(args.file)
    model = open_model(args.model, **rope_options(args))
    tokenizer = load_tokenizer(model.gguf)
    tokens = tokenizer.encode(text, add_special=True, parse_special=False)
    if args.chunks is not None:
        tokens = tokens[:args.chunks * args.ctx]
    bos_id = tokenizer.bos_id if tokenizer.add_bos else None
    cut_windows(tokens, args.ctx, bos_id)  # too short a text fails before the model loads
    backend = open_backend(args.backend, model, options)
    result = perplexity(backend, tokens, args.ctx, bos_id, progress=not args.quiet)
    print(f"{len(tokens)} tokens, {result.n_windows} windows of {args.ctx}, {result.n_scored} scored "
          f"({args.backend} backend)")
    print(",".join(f"[{i + 1}]{ppl:.4f}" for i, ppl in enumerate(result.running_ppl)))  # llama.cpp's line
    print(f"PPL = {result.ppl:.4f} +/- {result.error:.5f}")
    return 0
