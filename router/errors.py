"""Errors the API answers with, in OpenAI's JSON shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    status_code = 500
    error_type = "server_error"
    code: str | None = None
    retry_after_s: int | None = None  # sent as Retry-After: when to try again

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    @property
    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class ClientError(APIError):
    """The request's fault (4xx): OpenAI's invalid_request_error."""

    error_type = "invalid_request_error"


class InvalidRequest(ClientError):
    status_code = 400


class Unauthorized(ClientError):
    status_code, code = 401, "invalid_api_key"


class ModelNotFound(ClientError):
    status_code, code = 404, "model_not_found"


class RequestTooLarge(ClientError):
    status_code, code = 413, "request_too_large"


class BodyTimeout(ClientError):
    """The request's body did not arrive whole in time (a trickle, or a body never finished)."""

    status_code, code = 408, "request_timeout"


class UnsupportedMediaType(ClientError):
    status_code, code = 415, "unsupported_media_type"


class Overloaded(APIError):
    status_code, error_type, code = 429, "rate_limit_error", "rate_limit_exceeded"
    retry_after_s = 1


class TooManyAuthFailures(ClientError):
    """An address that sent too many wrong API keys: it waits Retry-After seconds before the next try."""

    status_code, error_type, code = 429, "rate_limit_error", "too_many_authentication_failures"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PreprocessingBusy(APIError):
    """Every tokenizer thread is taken (runaway renders included): come back shortly."""

    status_code, code = 503, "server_busy"
    retry_after_s = 1


class NoEngineAvailable(APIError):  # server_error, as every 5xx here
    status_code, code = 503, "no_engine_available"


class EngineFailed(APIError):
    """An engine died or failed while serving a request that could not be retried."""

    status_code, code = 502, "engine_failed"


class RequestTimeout(APIError):
    status_code, code = 504, "timeout"
