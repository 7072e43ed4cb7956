"""Our RopeScaling in the shape of transformers' `rope_parameters`, for the tests that compare with it."""

from airframe.rope_scaling import RopeScaling


def hf_rope_parameters(s: RopeScaling, base: float) -> dict:
    params = {"rope_type": s.type, "factor": s.factor, "rope_theta": base}
    if s.type != "linear":
        params["original_max_position_embeddings"] = s.original_ctx
    if s.type == "yarn":
        params.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow)
    if s.type == "llama3":
        params.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    return params
