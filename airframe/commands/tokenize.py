"""`airframe tokenize MODEL TEXT`: the token ids of a text, with their vocabulary entries."""

import json

from ..gguf_file import GGUFFile
from ..models import resolve_model
from ..tokenizer import load_tokenizer

HELP = "print the token ids of a text (llama.cpp's tokenization, from the GGUF's own vocabulary)"


def add_arguments(p):
    p.add_argument("model", metavar="MODEL", help="a GGUF path or a known model name")
    p.add_argument("text", metavar="TEXT", help="the text to tokenize")
    p.add_argument("--json", action="store_true", help="print the ids as one JSON array")
    p.add_argument("--no-bos", action="store_true", help="do not add the BOS/EOS tokens the file asks for")
    p.add_argument("--parse-special", action="store_true",
                   help="read control tokens written in the text (such as <|im_start|>) as single ids")


def run(args) -> int:
    tokenizer = load_tokenizer(GGUFFile(resolve_model(args.model)))
    ids = tokenizer.encode(args.text, add_special=not args.no_bos, parse_special=args.parse_special)
    if args.json:
        print(json.dumps(ids))
        return 0
    for token_id in ids:
        print(f"{token_id:>8}  {json.dumps(tokenizer.token_text(token_id), ensure_ascii=False)}")
    return 0
