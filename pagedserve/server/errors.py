"""Every failure the server reports is an OpenAI error object:
``{"error": {"message", "type", "param", "code"}}``, with the HTTP status OpenAI would use."""

from __future__ import annotations

import sys
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagedserve.logger import get_logger
from pagedserve.sampling_params import InvalidSamplingParam
from pagedserve.server.protocol import ErrorInfo, ErrorResponse

logger = get_logger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
REQUEST_TOO_LARGE = "request_too_large"


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def from_value_error(exc: ValueError) -> APIError:
    """What the engine or SamplingParams rejected a request with, as a 400."""
    return bad_request(str(exc), param=getattr(exc, "param", None))


def stream_error(exc: Exception) -> ErrorResponse:
    """The event that ends a stream that failed after its 200 went out: a request the engine
    refused once it ran (a grammar that did not compile in time, or accepts nothing) is the
    client's error, as it would have been a 400 before the stream began."""
    if isinstance(exc, APIError):
        return ErrorResponse(error=exc.info)
    if isinstance(exc, InvalidSamplingParam):
        return ErrorResponse(error=from_value_error(exc).info)
    return ErrorResponse(error=ErrorInfo(message=str(exc), type=SERVER_ERROR))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(InvalidSamplingParam, _value_error)
    app.add_exception_handler(Exception, _unexpected_error)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
    return from_value_error(exc).response()


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI answers 422 with its own shape; OpenAI answers 400 with the first culprit."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(part) for part in first.get("loc", ())]
    if loc[:1] in (["body"], ["query"], ["path"]):  # where the field was, not its name
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        return bad_request(message.rstrip(": ")).response()
    where = ".".join(loc) or "body"
    if first.get("type") == "extra_forbidden":
        first = {**first, "msg": "this field is unknown or not supported by this server"}
    extra = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    # param names the top-level field; the message keeps the full path.
    return bad_request(f"{where}: {first['msg']}{extra}", param=loc[0] if loc else None
                       ).response()


async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    status = HTTPStatus(exc.status_code)
    message = exc.detail if isinstance(exc.detail, str) else status.phrase
    if message == _FASTAPI_PARSE_ERROR and exc.__cause__ is not None:
        message = f"the request body is not valid JSON: {_unparsable(exc.__cause__)}"
    kind = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
    code = REQUEST_TOO_LARGE if status == HTTPStatus.REQUEST_ENTITY_TOO_LARGE else None
    return APIError(exc.status_code, message, type=kind, code=code).response()


# What FastAPI answers when its JSON parse raises anything but a syntax error.
_FASTAPI_PARSE_ERROR = "There was an error parsing the body"


def _unparsable(cause: BaseException) -> str:
    if isinstance(cause, RecursionError):
        return "it is nested too deeply"
    if isinstance(cause, UnicodeDecodeError):
        return "it is not UTF-8 text"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return f"a number has more than {sys.get_int_max_str_digits()} digits"
    return type(cause).__name__


async def _unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error while serving a request")
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(exc).__name__}",
                    type=SERVER_ERROR).response()
