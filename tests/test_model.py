"""open_model: a known name or a path, parsed once, with the user's RoPE scaling applied to its config."""

import pytest

from airframe.errors import ModelNotFoundError, ParameterError
from airframe.model import open_model
from airframe.rope_scaling import NONE, RopeScaling


def test_a_known_name_and_its_path_give_the_same_model(smollm2_path):
    by_name, by_path = open_model("smollm2-135m"), open_model(smollm2_path)
    assert by_name.path == by_path.path == smollm2_path
    assert by_name.config == by_path.config and by_name.gguf.path == smollm2_path
    assert by_name.rope_override is None and by_name.config.rope_scaling == NONE


def test_rope_scaling_is_applied_to_the_config(smollm2_path):
    model = open_model(smollm2_path, rope_scaling="yarn", rope_scale=2.0)
    assert model.rope_override == RopeScaling("yarn", 2.0)
    assert model.config.rope_scaling == RopeScaling("yarn", 2.0, model.config.ctx_train)


def test_errors_name_what_was_wrong(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        open_model("no-such-model")
    with pytest.raises(ParameterError, match="--rope-scale 0.5, expected a number >= 1"):
        open_model(tmp_path / "never-read.gguf", rope_scaling="linear", rope_scale=0.5)
