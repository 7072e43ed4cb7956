"""The `airframe` command line.

Each subcommand lives in `airframe/commands/<name>.py` with `HELP`, `add_arguments(parser)` and
`run(args) -> int`; this file only finds them, so adding a command never touches the others.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from tqdm import tqdm

from . import commands
from .errors import AirframeError


def _command_modules():
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            yield info.name.replace("_", "-"), importlib.import_module(f"{commands.__name__}.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="airframe", description="Run GGUF language models on the GPU.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in _command_modules():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except AirframeError as e:
        _close_bars()
        print(f"airframe: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _close_bars() -> None:
    """Progress bars the error left open (their frames live on in its traceback) are closed, which
    ends or clears their line, so the message starts a line of its own."""
    for bar in list(tqdm._instances):
        bar.close()


def quant_verify_main(argv: list[str] | None = None) -> int:
    """The `quant_verify` console script: the same as `airframe quant-verify`."""
    return main(["quant-verify", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
