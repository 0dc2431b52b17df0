"""Errors the API answers with, in OpenAI's JSON shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    status_code = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class InvalidRequest(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(APIError):
    status_code = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFound(APIError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class Overloaded(APIError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"


class NoEngineAvailable(APIError):
    status_code = 503
    error_type = "server_error"
    code = "no_engine_available"


class EngineFailed(APIError):
    """An engine died or failed while serving a request that could not be retried."""

    status_code = 502
    error_type = "server_error"
    code = "engine_failed"


class RequestTimeout(APIError):
    status_code = 504
    error_type = "server_error"
    code = "timeout"
