"""`airframe detokenize MODEL ID...`: the text of a list of token ids."""

from ..errors import ParameterError
from ..gguf_file import GGUFFile
from ..models import resolve_model
from ..tokenizer import load_tokenizer

HELP = "print the text of a list of token ids"


def add_arguments(p):
    p.add_argument("model", metavar="MODEL", help="a GGUF path or a known model name")
    p.add_argument("ids", nargs="+", metavar="ID", help="token ids")
    p.add_argument("--skip-special", action="store_true", help="leave out control tokens such as BOS")


def run(args) -> int:
    ids = []
    for text in args.ids:
        try:
            ids.append(int(text))
        except ValueError:
            raise ParameterError(f"token id {text!r} is not an integer") from None
    tokenizer = load_tokenizer(GGUFFile(resolve_model(args.model)))
    print(tokenizer.decode(ids, skip_special=args.skip_special))
    return 0
