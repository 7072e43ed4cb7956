"""Loading WGSL programs from `shaders/`: the only text processing WGSL ever gets.

`#include "file.wgsl"` lines are replaced by that file (paths relative to `shaders/`, recursively,
each file at most once per program) and `{NAME}` placeholders by the values in `defines`.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Callable

from ..errors import AirframeError
from ..resources import data_dir

_INCLUDE = re.compile(r'^[ \t]*#include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)
_PLACEHOLDER = re.compile(r"\{([A-Z][A-Z0-9_]*)\}")


@lru_cache(maxsize=None)
def _read(name: str) -> str:
    path = data_dir("shaders") / name
    if not path.is_file():
        raise AirframeError(f"shader {name!r} not found, expected a file {path}")
    return path.read_text()


def _substitute(text: str, defines: dict[str, str], where: str, default: Callable[[str], str] | None) -> str:
    def value(match: re.Match) -> str:
        key = match.group(1)
        if key in defines:
            return str(defines[key])
        if default is not None:
            return default(key)
        raise AirframeError(f"{where}: placeholder {{{key}}} has no value; given: {sorted(defines)}")

    return _PLACEHOLDER.sub(value, text)


def load_wgsl(name: str, defines: dict[str, str] | None = None,
              default: Callable[[str], str] | None = None) -> str:
    """The WGSL source of `shaders/<name>` with includes resolved and placeholders filled;
    `default(name)` gives the value of a placeholder that `defines` lacks (else an error)."""
    defines = dict(defines or {})
    seen: set[str] = set()

    def expand(file: str) -> str:
        if file in seen:
            return ""
        seen.add(file)
        text = _substitute(_read(file), defines, file, default)
        return _INCLUDE.sub(lambda m: expand(_substitute(m.group(1), defines, file, default)), text)

    return expand(_substitute(name, defines, name, default))
