#!/usr/bin/env python3
"""Write a synthetic GGUF model (random weights, real names and metadata, a real tokenizer).

    python scripts/make_synthetic_gguf.py --family llama --shape llama3.2-1b --qtype Q4_K_M -o out.gguf

See airframe/synthetic.py for what the file holds.
"""

from __future__ import annotations

import argparse
import sys
import time

from airframe.errors import AirframeError
from airframe.family import families_by_name
from airframe.synthetic import MIXES, SHAPES, TOKENIZER_SOURCE, write_synthetic_gguf
from airframe.quants import SUPPORTED


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama", choices=sorted(families_by_name()),
                        help="a family file in family/ (its name without .toml)")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--qtype", default="Q8_0",
                        help=f"one of {', '.join(t.name for t in SUPPORTED)} or a mix: {', '.join(MIXES)}")
    parser.add_argument("-o", "--output", required=True, help="path of the GGUF file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=None,
                        help="vocabulary size (the tokenizer is cut or padded to it)")
    parser.add_argument("--tokenizer", default=TOKENIZER_SOURCE,
                        help="model name or GGUF path whose tokenizer.* keys are copied")
    parser.add_argument("--fast", action="store_true",
                        help="generate one layer's weights and repeat them in every layer")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        path = write_synthetic_gguf(args.output, args.family, args.shape, args.qtype, args.seed,
                                    vocab=args.vocab, fast=args.fast, tokenizer=args.tokenizer,
                                    progress=True)
    except AirframeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = path.stat().st_size
    print(f"wrote {path} ({size / 1e9:.3f} GB) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
