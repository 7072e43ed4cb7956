"""`airframe quant-verify [MODEL]`: GPU decoding of every quant type against gguf's numpy code."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from gguf import GGMLQuantizationType

from ..errors import ModelNotFoundError, ParameterError
from ..models import resolve_model
from ..quant_verify import format_table, verify_model, verify_synthetic

HELP = "check that the GPU decodes every quant type exactly as the gguf package's numpy code does"
# A test hook, not a user option: "Q4_0=/path/broken.wgsl,Q4_K=..." swaps in other decoder files.
DECODER_ENV = "AIRFRAME_QUANT_DECODER"


def add_arguments(p):
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="a model name or GGUF path; without it, a synthetic tensor of every supported type")
    p.add_argument("--full", action="store_true", help="check every row (default: sampled rows)")
    p.add_argument("--rows", type=int, default=64, metavar="N",
                   help="rows checked per tensor, evenly spread with the first and last (default 64)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def decoder_override(value: str) -> dict:
    """Parse AIRFRAME_QUANT_DECODER into {quant type: decoder file}."""
    override = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, _, path = item.partition("=")
        try:
            override[GGMLQuantizationType[name.strip().upper()]] = Path(path.strip()).resolve()
        except KeyError:
            raise ParameterError(f"{DECODER_ENV}: {name!r} is not a quant type; expected TYPE=FILE,...") from None
    return override


def run(args) -> int:
    try:
        override = decoder_override(os.environ.get(DECODER_ENV, ""))
        options = dict(rows=args.rows, decoder_override=override, progress=not (args.quiet or args.json))
        if args.model is None:
            report = verify_synthetic(**options)
        else:
            report = verify_model(resolve_model(args.model), full=args.full, **options)
    except (ParameterError, ModelNotFoundError) as e:
        print(f"airframe quant-verify: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_table(report))
    return 0 if report.ok else 1
