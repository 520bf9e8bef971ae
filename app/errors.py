"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

A client's mistake is a 4xx wherever it is found: pydantic at the edge, `SamplingParams`,
or the engine's limit checks on the replica (which cross Ray wrapped in a `RayTaskError`).
Only a real server fault is a 500.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import (BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError,
                                  RequestCancelledError)
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.schemas import INVALID_UNICODE
from replicas.protocol import (InvalidRequestError, QueueFullError, ReplicaUnhealthyError,
                               RequestRejected)

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                   408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}
MAX_MESSAGE_CHARS = 1024  # an error message never echoes more of the client's input than this
ENGINE_RETRY_AFTER_S = 1  # a dead engine replica is replaced (or another takes over) about this fast
RETRY_AFTER_OVERLOAD_S = 1  # a 429 with no measured drain rate behind it (Serve's queue, the ingress's wait)
RETRY_AFTER_NO_REPLICA_S = 5  # no replica at all: one is starting
# The engine's refusals, by kind (the most specific first): HTTP status and OpenAI error type.
_STATUS_BY_REFUSAL: tuple[tuple[type[RequestRejected], int, str], ...] = (
    (InvalidRequestError, 400, "invalid_request_error"),
    (QueueFullError, 429, "rate_limit_error"),
    (ReplicaUnhealthyError, 503, "server_error"),
    (RequestRejected, 400, "invalid_request_error"),
)
# A replica process that died or cannot be reached: the request may be retried (503).
REPLICA_GONE = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)


class ClientDisconnected(Exception):
    """The client went away: nothing to answer, nothing to log above INFO."""


class OpenAIError(Exception):
    """An error answered as an OpenAI error object with an HTTP status."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters)"
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status_code, "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def from_exception(exc: BaseException) -> OpenAIError:
    """Map anything raised while serving a request to an OpenAIError (4xx by type, else 500)."""
    if isinstance(exc, OpenAIError):
        return exc
    rejected = _find_cause(exc, RequestRejected)
    if rejected is not None:
        headers = ({"Retry-After": str(rejected.retry_after_s)}
                   if rejected.retry_after_s is not None else None)
        status, error_type = next((status, kind) for cls, status, kind in _STATUS_BY_REFUSAL
                                  if isinstance(rejected, cls))
        return OpenAIError(status, rejected.message, rejected.param, rejected.code, error_type, headers)
    if isinstance(exc, BackPressureError):  # Serve's own bounded handle queue is full
        return OpenAIError(429, "the server is overloaded; retry later", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_OVERLOAD_S)})
    if isinstance(exc, DeploymentUnavailableError):
        return OpenAIError(503, "no model replica is available; retry later",
                           code="engine_unavailable", headers={"Retry-After": str(RETRY_AFTER_NO_REPLICA_S)})
    if replica_gone(exc):
        return engine_unavailable()
    if isinstance(exc, (RequestCancelledError, ClientDisconnected)):
        logger.info("client disconnected; request cancelled")
        return OpenAIError(499, "client disconnected", code="client_disconnected")
    logger.error("server fault while serving a request", exc_info=exc)
    return OpenAIError(500, f"internal server error ({type(exc).__name__})")


def replica_gone(exc: BaseException) -> bool:
    """True when `exc` says the engine replica died or cannot be reached (safe to retry)."""
    return isinstance(exc, REPLICA_GONE) or _find_cause(exc, REPLICA_GONE) is not None


def engine_unavailable() -> OpenAIError:
    return OpenAIError(503, "the model replica serving this request stopped; retry the request",
                       code="engine_unavailable", headers={"Retry-After": str(ENGINE_RETRY_AFTER_S)})


def _find_cause(exc: BaseException, kind: Any) -> Any:
    """Unwrap Ray's `RayTaskError` (`.cause`) and Python exception chains to find `kind`."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, kind):
            return cur
        todo += [getattr(cur, "cause", None), cur.__cause__, cur.__context__]
    return None


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """The first pydantic error as a 400 naming its field (`messages.0.role`)."""
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == INVALID_UNICODE:
        param = first.get("ctx", {}).get("param")
        return OpenAIError(400, first.get("msg", "invalid Unicode"), param=param, code="invalid_unicode")
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"invalid JSON body: {first.get('ctx', {}).get('error', first['msg'])}",
                           code="invalid_json")
    param, tag = _param(first.get("loc", ()))
    if tag:  # a union: every member failed, so say which shapes are accepted
        located = [_param(e.get("loc", ())) for e in errors]
        alternatives = dict.fromkeys(t for p, t in located if p == param and t)
        message = f"invalid value; expected {' or '.join(alternatives)}"
    else:
        message = first.get("msg", "invalid value")
    if param:
        message = f"{param}: {message}"
    return OpenAIError(400, message, param=param or None, code="invalid_value")


# pydantic names the member of a union in the error location ("str", "list[int]"): not a field.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*|.*\[.*\])$")


def _param(loc: tuple[int | str, ...]) -> tuple[str, str | None]:
    """Dotted field path of an error location, and the union member it stopped at, if any."""
    parts: list[str] = []
    for part in loc:
        if part == "body" and not parts:
            continue
        if isinstance(part, str) and _UNION_TAG.match(part):
            return ".".join(parts), part
        parts.append(str(part))
    return ".".join(parts), None


def install_handlers(api: FastAPI) -> None:
    """Route every error FastAPI or our code raises into the OpenAI error shape."""

    @api.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @api.exception_handler(RequestRejected)  # e.g. SamplingParams' InvalidRequestError
    async def _rejected(_: Request, exc: RequestRejected) -> JSONResponse:
        return from_exception(exc).response()

    @api.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @api.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else ""
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return OpenAIError(exc.status_code, message).response()

    @api.exception_handler(Exception)
    async def _fault(_: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()
