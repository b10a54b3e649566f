"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

400 invalid parameters, wrong types, malformed JSON, empty prompts, prompts over the context;
401 a missing or wrong API key; 404 an unknown model or route; 503 while the engine is dead or the
server is draining; 500 anything unexpected (the message says what, the log has the traceback).
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="service_unavailable")


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming the parameter (`messages.0.role`)."""
    errors = e.errors()
    if not errors:
        return bad_request("invalid request")
    err = errors[0]
    if err.get("type") == "json_invalid":
        return bad_request(f"malformed JSON body: {err.get('msg', '')}", code="invalid_json")
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # drop union-branch names pydantic puts in the path (`prompt.list[int].0` → `prompt.0`)
    loc = [x for x in loc if not re.fullmatch(r"[a-z]+\[.*\]|str|int|float|bool|function-.*", x)]
    param = ".".join(loc) or None
    if err.get("type") == "model_type" and not loc:
        return bad_request("the request body must be a JSON object", code="invalid_type")
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        return bad_request(f"missing required parameter: '{param}'", param=param, code="missing_required_parameter")
    return bad_request(f"invalid value for '{param}': {msg}", param=param, code="invalid_value")


_PARAM_RE = re.compile(r"^([a-z_]+) ")


def from_value_error(e: ValueError, param: str | None = None) -> APIError:
    """A ValueError from SamplingParams or the processor: a message that starts with a field's name
    names that parameter; others get `param` (the prompt, the messages)."""
    message = str(e)
    match = _PARAM_RE.match(message)
    if match and match.group(1) in _SAMPLING_FIELDS:
        param = match.group(1)
    return bad_request(message, param=param)


_SAMPLING_FIELDS = {
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "logit_bias", "top_logprobs",
}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return APIError(exc.status_code, detail or phrase).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("internal error serving %s", request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}").response()
