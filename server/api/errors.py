"""The OpenAI error envelope and the exceptions that map onto it."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from server.api.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error the client sees as an HTTP status plus an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=_TYPES.get(self.status, "invalid_request_error"),
                         param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return _AsciiJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class _AsciiJSONResponse(JSONResponse):
    """Escapes non-ASCII, so a message quoting client text (even a lone surrogate) always renders."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSONResponse carrying the OpenAI error envelope."""
    return APIError(status, message, param, code, headers).response()
