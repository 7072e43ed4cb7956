"""The --rope-scaling / --rope-scale flags reach the model and its backend from run, serve and perplexity."""

import pytest

from airframe.cli import build_parser, main
from airframe.commands._rope import rope_options
from airframe.errors import ParameterError
from airframe.rope_scaling import RopeScaling


@pytest.mark.parametrize("command", [["run", "m", "hi"], ["serve", "m"], ["perplexity", "m", "--file", "f"],
                                     ["chat", "m"]])
def test_flags_parse_into_open_model_options(command):
    args = build_parser().parse_args(command + ["--rope-scaling", "yarn", "--rope-scale", "4"])
    assert rope_options(args) == {"rope_scaling": "yarn", "rope_scale": 4.0}
    plain = build_parser().parse_args(command)
    assert rope_options(plain) == {"rope_scaling": None, "rope_scale": None}


def test_run_passes_the_scaling_to_the_backend(monkeypatch, capsys):
    from airframe.model import open_model

    seen = {}

    def fake_open_model(model, rope_scaling=None, rope_scale=None):
        seen.update(rope_scaling=rope_scaling, rope_scale=rope_scale)
        return open_model(model, rope_scaling, rope_scale)

    def fake_open_backend(name, model, options):
        seen.update(name=name, override=model.rope_override)
        raise ParameterError("stop here: the options were seen")

    monkeypatch.setattr("airframe.model.open_model", fake_open_model)
    monkeypatch.setattr("airframe.engine.open_backend", fake_open_backend)
    code = main(["run", "smollm2-135m", "hi", "--backend", "reference", "--rope-scaling", "linear", "--rope-scale", "2"])
    assert seen == {"name": "reference", "rope_scaling": "linear", "rope_scale": 2.0,
                    "override": RopeScaling("linear", 2.0)}
    assert code == 1
    assert "stop here" in capsys.readouterr().err


def test_a_bad_scale_is_refused_with_its_range(capsys):
    code = main(["perplexity", "smollm2-135m", "--file", __file__, "--ctx", "16", "--backend", "reference",
                 "--rope-scaling", "yarn", "--rope-scale", "0.5", "-q"])
    assert code == 1
    assert ">= 1" in capsys.readouterr().err
