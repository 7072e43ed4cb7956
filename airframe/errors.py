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



EXCERPT_CHARS = 80


def excerpt(value, limit: int = EXCERPT_CHARS) -> str:
    """repr(value), cut to about `limit` characters with its full length said: a hostile file's
    megabyte string or 262,144-entry array must not become a megabyte error message."""
    if isinstance(value, (str, bytes)):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}... ({len(value)} {'chars' if isinstance(value, str) else 'bytes'})"
    if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) == 1:
        items = value.tolist() if hasattr(value, "tolist") else list(value)
        if len(items) <= 8 and len(text := repr(items)) <= limit:
            return text
        items = ", ".join(excerpt(v, 16) for v in items[:4])
        return f"[{items}, ...] ({len(value)} items)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
