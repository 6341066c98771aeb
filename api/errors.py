"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Handlers are installed on the app so that no traceback, exception class or internal path ever reaches a
client; the details go to the server log instead.
"""
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
          411: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "service_unavailable"}


class APIError(Exception):
    """An error answered to the client as an OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.error_type = error_type or _TYPES.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> str:
        """The error as a server-sent event, for a stream that fails after it started."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    # The same answer for a missing adapter and for another tenant's adapter (DESIGN §5).
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    code="model_not_found", param="model")


def adapter_not_found(name: str) -> APIError:
    return APIError(404, f"The adapter `{name}` does not exist or you do not have access to it.",
                    code="adapter_not_found", param="name")


def rate_limited(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)})


def unavailable(message: str, retry_after_s: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, code="service_unavailable", headers=headers)


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {limit} bytes", code="request_too_large")


def over_byte_quota(namespace: str | None, quota: int, what: str, held: int | None = None,
                     retry: str = "unload an adapter first") -> APIError:
    """403: a tenant's adapter files over its byte quota (max_adapter_bytes)."""
    holder = f"tenant {namespace!r}" if namespace is not None else "the local namespace"
    holding = f" and holds {held}" if held is not None else ""
    return APIError(403, f"{holder} may hold at most {quota} bytes of adapter files (max_adapter_bytes)"
                    f"{holding}: {what} would not fit; {retry}", code="adapter_quota_exceeded", param="files")


def internal_error() -> APIError:
    return APIError(500, "The server had an internal error while processing the request.", code="internal_error")


def invalid_request(errors: Sequence[Any]) -> APIError:
    """The 400 for pydantic's validation errors of a request: the first one, naming its field."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":       # its loc is a byte offset, not a field
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    return bad_request(f"{param}: {message}" if param else message, param=param)


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Answer every failure with an OpenAI error object; `on_error(status)` counts them."""
    def respond(error: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(error.status)
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(invalid_request(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        limit = request.scope.get(MAX_BODY_SIZE_SCOPE_KEY)
        if exc.status_code == 413 and limit is not None:     # Starlette's body limit: name the limit
            return respond(too_large(limit))
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return respond(APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(internal_error())
