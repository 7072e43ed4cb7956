"""The exceptions airframe raises at its boundaries.

Every problem a user can cause (a bad file, a bad name, a bad parameter) is an AirframeError
subclass whose message says what was found and what was expected.
"""


class AirframeError(Exception):
    """Base class of every error airframe reports to a user."""


class GGUFError(AirframeError):
    """A GGUF file is truncated, malformed or inconsistent."""


class UnsupportedError(AirframeError):
    """The file is valid but uses something airframe does not run (architecture, quant type)."""


class ModelNotFoundError(AirframeError):
    """A model name or path does not resolve to a file."""


class TokenizerError(AirframeError):
    """The tokenizer described by the GGUF metadata cannot be built."""


class ParameterError(AirframeError):
    """A generation or command parameter is out of its allowed range."""


class ContextOverflowError(ParameterError):
    """A prompt (plus the tokens asked for) does not fit in the context."""


class GPUError(AirframeError):
    """No usable GPU adapter, or the device failed."""


class NonFiniteError(AirframeError):
    """A forward pass produced NaN or infinite logits: the weights (or an activation) are damaged."""
