"""Where the data folders (`shaders/`, `family/`) are, installed or in a checkout."""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """`shaders` or `family`: inside the wheel they sit in the package, in a checkout beside it."""
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"airframe data folder {name!r} not found next to {_PACKAGE}")


def shader_path(name: str) -> Path:
    return data_dir("shaders") / name


def family_dir() -> Path:
    return data_dir("family")
