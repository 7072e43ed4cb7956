"""Every error the server answers with, in OpenAI's JSON shape.

`{"error": {"message", "type", "param", "code"}}` with a 4xx, 500 or 503 status; the message says
what was found and what was expected, like every AirframeError.
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ..errors import AirframeError, ContextOverflowError, GPUError, NonFiniteError, ParameterError, UnsupportedError
from .queue import QueueFullError
from . import schemas
from .schemas import ErrorDetail, ErrorResponse

RETRY_AFTER_SECONDS = 1


class ApiError(Exception):
    """An HTTP error with OpenAI's fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


def from_airframe(error: AirframeError, param: str | None = None) -> ApiError:
    """Map one of the engine's errors to its HTTP status."""
    if isinstance(error, ContextOverflowError):
        return ApiError(400, str(error), param="messages" if param is None else param, code="context_length_exceeded")
    if isinstance(error, NonFiniteError):  # the served model is damaged, not the request: a server error
        return ApiError(500, str(error), type="server_error", code="non_finite_logits")
    if isinstance(error, GPUError):  # the device failed, not the request
        return ApiError(500, str(error), type="server_error", code="gpu_error")
    if isinstance(error, QueueFullError):
        return overloaded(str(error))
    if isinstance(error, UnsupportedError):
        return ApiError(400, str(error), param=param, code="unsupported_parameter")
    if isinstance(error, ParameterError):
        return ApiError(400, str(error), param=param, code="invalid_value")
    return ApiError(400, str(error), param=param)


def overloaded(message: str) -> ApiError:
    return ApiError(503, message, type="server_overloaded", code="overloaded",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def _found(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_FIELD_NAMES = {
    name
    for model in (schemas.ChatCompletionRequest, schemas.CompletionRequest, schemas.TokenizeRequest,
                  schemas.DetokenizeRequest, schemas.ChatMessage, schemas.ContentPart, schemas.StreamOptions,
                  schemas.ResponseFormat, schemas.ToolCallIn, schemas.FunctionCall, schemas.ToolDef,
                  schemas.FunctionDef, schemas.NamedToolChoice, schemas.NamedFunction)
    for name in model.model_fields
}


def _param(loc: tuple) -> str | None:
    """The dotted field path of a validation error, without pydantic's union-member tags ('str')."""
    parts = []
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if not (isinstance(part, int) or part in _FIELD_NAMES):
            break
        parts.append(str(part))
    return ".".join(parts) or None


def from_validation(error: RequestValidationError, content_type: str | None) -> ApiError:
    """FastAPI's 422 for a body that does not fit the schema, as OpenAI's 400."""
    # Of a union's failed members, the one that got furthest (or a check of ours) says the most.
    first = max(error.errors(), key=lambda e: (e.get("type") == "value_error", len(e.get("loc", ()))))
    param = _param(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    if param is None and isinstance(first.get("input"), bytes):
        # Only JSON content types are parsed: a page in a browser cannot post JSON here without
        # a CORS preflight, which is what keeps other web sites off a server on localhost.
        return ApiError(400, f"the request body must be JSON sent with 'Content-Type: application/json'; "
                        f"found Content-Type {content_type!r}", code="invalid_content_type")
    where = f"'{param}'" if param else "the request body"
    found = f"; found {_found(first['input'])}" if "input" in first and param and first.get("type") != "missing" else ""
    extra = f" (and {len(error.errors()) - 1} more problems)" if len(error.errors()) > 1 else ""
    return ApiError(400, f"{where}: {first.get('msg')}{found}{extra}", param=param, code="invalid_value")
