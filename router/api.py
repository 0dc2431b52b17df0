"""The FastAPI app: OpenAI-compatible routes, /health, /metrics, and errors in OpenAI's shape.
Serving one request (whole or streamed) is streaming.py's. With an API key, everything but /health
needs it; templates and tokenization run on the preprocessor's threads, never on the event loop."""

from __future__ import annotations

import functools
import hmac
import importlib.metadata
import logging
import time
from contextlib import asynccontextmanager
from functools import partial
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.control.gc_freeze import freeze_startup_heap
from pdserve.router.auth_throttle import AuthThrottle
from pdserve.router.body_budget import BodyBudget
from pdserve.router.body_limit import BodyLimit
from pdserve.router.config import RouterConfig
from pdserve.router.errors import (
    APIError,
    InvalidRequest,
    ModelNotFound,
    RequestTooLarge,
    TooManyAuthFailures,
    Unauthorized,
    UnsupportedMediaType,
)
from pdserve.router.gateway import Gateway
from pdserve.router.body_route import BodyRoute, is_json
from pdserve.router.responses import (
    AutoToolCallFormatter,
    ChatFormatter,
    CompletionFormatter,
    Prompt,
    ToolCallFormatter,
)
from pdserve.router.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.router.specs import chat_specs, check_n, check_raw_choices, completion_specs
from pdserve.router.structured_output import checked_constraint, origin_of
from pdserve.router.tool_calls import ToolCalling, tool_calling, with_tags_shown
from pdserve.router.streaming import CLIENT_CLOSED_REQUEST, endpoint_label, respond

log = logging.getLogger("pdserve.router.api")

def create_app(config: RouterConfig, gateway: Gateway | None = None, on_started: list | None = None) -> FastAPI:
    """The router's app: one FastAPI route per endpoint."""
    gateway = gateway or Gateway(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        freeze_startup_heap()  # the tokenizer and transformers' modules: never walked by a collection again
        for callback in on_started or ():
            callback(gateway)
        try:
            yield
        finally:
            await gateway.close()

    # redirect_slashes off: Starlette's 307 for /v1/completions/ pointed at the Host header's server
    app = RouterApp(title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                    redirect_slashes=False)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.state.gateway = gateway
    app.state.body_budget = BodyBudget(config.max_body_bytes_in_flight, config.body_budget_wait_s,
                                       undeclared_bytes=config.max_request_bytes)
    _install_error_handlers(app, gateway)
    _install_routes(app, gateway)
    return app


@functools.cache
def _installed_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


class RouterApp(FastAPI):
    """FastAPI, less the per-request question to OpenTelemetry that its __call__ asks of each HTTP request
    (pdserve's metrics are Prometheus'): HTTP requests go straight to Starlette's __call__."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await Starlette.__call__(self, scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    def build_middleware_stack(self) -> ASGIApp:
        """Starlette's stack, with the `Exception` handler also in the exception layer, beside every other
        handler: an unexpected error is answered (a 500) and logged once, not answered by the outermost layer
        and then raised again into the server."""
        stack = super().build_middleware_stack()
        layer = stack
        while not isinstance(layer, ExceptionMiddleware):
            layer = layer.app
        layer.add_exception_handler(Exception, self.exception_handlers[Exception])
        return stack


# ---- errors ----

SERVED_ENDPOINTS = ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics and "
                    "GET /version")


def _route_message(request: Request, exc: StarletteHTTPException) -> str | None:
    """Starlette's bare "Not Found" / "Method Not Allowed" for a path or method the router has no route for,
    said with what it serves; None for any other HTTP error."""
    path = request.url.path[:100]
    if exc.status_code == 404 and exc.detail == "Not Found":
        return f"{request.method} {path} is not an endpoint of this server: it serves {SERVED_ENDPOINTS}"
    if exc.status_code == 405 and exc.headers and "Allow" in exc.headers:
        return f"{path} takes {exc.headers['Allow']}, not {request.method}"
    return None


def _error_response(gateway: Gateway, request: Request, error: APIError) -> JSONResponse:
    gateway.metrics.count_request(endpoint_label(request), str(error.status_code))
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    problems, param = [], None
    for error in exc.errors():
        if error.get("type") == "json_invalid":  # loc is ("body", character offset), not a field
            detail = error.get("ctx", {}).get("error", "")
            return (f"the request body is not valid JSON ({detail} at character {error['loc'][-1]}): "
                    "send one JSON object"), None
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        # a refusal of the whole body's validator names its field in ctx (schemas.refused)
        param = param or (location[0] if location else error.get("ctx", {}).get("param"))
        problems.append(f"{'.'.join(location) or 'body'}: {error.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(problems[:5]), param


def _body_missing(exc: RequestValidationError) -> bool:
    return any(error.get("type") == "missing" and tuple(error.get("loc", ())) == ("body",) for error in exc.errors())


def _install_error_handlers(app: FastAPI, gateway: Gateway) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(gateway, request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type")
        if not is_json(content_type) and not _body_missing(exc):  # curl -d sends a form's type
            return _error_response(gateway, request, UnsupportedMediaType(
                f"the body's Content-Type is {(content_type or 'not given')[:80]}: send JSON with the header "
                "`Content-Type: application/json`"))
        message, param = _validation_message(exc)
        return _error_response(gateway, request, InvalidRequest(message, param=param))

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect) -> Response:
        # the client left before its body was whole: nobody reads this answer; counted as nginx counts it
        gateway.metrics.count_request(endpoint_label(request), str(CLIENT_CLOSED_REQUEST))
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == RequestTooLarge.status_code:
            return _error_response(gateway, request, RequestTooLarge(str(exc.detail)))
        if exc.status_code == InvalidRequest.status_code and exc.__cause__ is not None:  # FastAPI's body parsing
            cause = exc.__cause__  # not UTF-8, nested past the recursion limit, an integer of 4300+ digits
            reason = f"{type(cause).__name__}: {str(cause).split(';')[0][:120]}"  # not the server-side hint
            message = f"the request body could not be read as JSON ({reason}): send one UTF-8 JSON object"
            return _error_response(gateway, request, InvalidRequest(message))
        error = APIError(_route_message(request, exc) or str(exc.detail))
        error.status_code, error.error_type = exc.status_code, "invalid_request_error"
        response = _error_response(gateway, request, error)
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error serving %s", request.url.path)
        return _error_response(gateway, request, APIError(f"internal server error: {type(exc).__name__}: {exc}"))


def _chat_formatter_class(tools: ToolCalling | None):
    """What answers a chat request: text, the constrained output as tool calls, or ("auto") the calls a parser
    reads in the text."""
    if tools is None:
        return ChatFormatter
    return partial(ToolCallFormatter if tools.constrains else AutoToolCallFormatter, tool_calling=tools)


# ---- routes ----

def _install_routes(app: FastAPI, gateway: Gateway) -> None:
    """The generation endpoints first (a request tries the routes in order), then the rest."""
    config = gateway.config

    throttle = AuthThrottle()

    async def check_api_key(request: Request) -> None:  # async: no thread-pool hop per request
        address = request.client.host if request.client else ""
        wait_s = throttle.wait_s(address)
        if wait_s:
            raise TooManyAuthFailures(f"too many requests with a wrong or missing API key from {address[:64]}: "
                                      f"wait {wait_s}s, then send the right key", retry_after_s=wait_s)
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            throttle.failed(address)
            raise Unauthorized("missing API key: send the header `Authorization: Bearer <key>`")
        if not hmac.compare_digest(key.strip().encode(), config.api_key.encode()):
            throttle.failed(address)
            raise Unauthorized("invalid API key: use the key the server was started with (--api-key)")

    # without a key there is nothing to check, and no dependency for FastAPI to solve per request
    key_checked = [Depends(check_api_key)] if config.api_key is not None else []

    def check_model(model: str | None) -> None:
        if model is not None and model not in (config.served_model_name, config.model):
            raise ModelNotFound(f"the model `{model}` does not exist: this server serves "
                                f"`{config.served_model_name}`", param="model")

    _install_generation_routes(app, gateway, key_checked, check_model)
    _install_info_routes(app, gateway, key_checked, check_model)


def _install_generation_routes(app: FastAPI, gateway: Gateway, key_checked: list,
                               check_model: Callable[[str | None], None]) -> None:
    config = gateway.config

    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        max_model_len, vocab_size = gateway.context_limits()
        check_n(body, body.num_prompts(), config.max_n)  # before any tokenizing: a 4 MiB batch is refused at once
        constraint = await checked_constraint(body, gateway.preprocessor, origin=origin_of(request))
        if body.has_text_prompt():
            tokenized = await gateway.preprocessor.run(gateway.tokenization.completion_prompts, body, max_model_len)
        else:  # token ids: nothing to tokenize, so no hop to the tokenizer's threads
            tokenized = gateway.tokenization.completion_prompts(body)
        prompts = [Prompt(text, ids) for text, ids in tokenized]
        specs = completion_specs(body, [p.token_ids for p in prompts], max_model_len, vocab_size, config.max_n,
                                 gateway.generation_defaults, constraint)
        formatter = partial(  # built by respond() once the engines have the request
            CompletionFormatter, model=config.served_model_name, tokenization=gateway.tokenization, prompts=prompts,
            n=body.n, num_logprobs=body.logprobs, return_token_ids=body.return_token_ids,
            include_usage=body.include_usage_in_stream, continuous_usage=body.continuous_usage_in_stream,
            num_prompt_logprobs=body.prompt_logprobs, echo=body.echo)
        return await respond(gateway, request, specs, formatter, body.stream)

    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        max_model_len, vocab_size = gateway.context_limits()
        tools = tool_calling(body, config.tool_call_parser)
        body = with_tags_shown(body, tools)
        constraint = await checked_constraint(body, gateway.preprocessor, tools, origin_of(request))
        text, token_ids = await gateway.preprocessor.run(gateway.tokenization.chat_prompt, body,
                                                         gateway.template_sandbox, max_model_len)
        specs = chat_specs(body, token_ids, max_model_len, config.max_n, gateway.generation_defaults, vocab_size,
                           constraint)
        formatter = partial(  # built by respond() once the engines have the request
            _chat_formatter_class(tools), model=config.served_model_name, tokenization=gateway.tokenization,
            prompts=[Prompt(text, token_ids)], n=body.n,
            num_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            return_token_ids=body.return_token_ids, include_usage=body.include_usage_in_stream,
            continuous_usage=body.continuous_usage_in_stream, num_prompt_logprobs=body.prompt_logprobs)
        return await respond(gateway, request, specs, formatter, body.stream)

    completions.check_raw_body = partial(check_raw_choices, max_n=config.max_n)  # before the prompts are validated
    for path, endpoint in (("/v1/completions", completions), ("/v1/chat/completions", chat_completions)):
        app.router.add_api_route(path, endpoint, methods=["POST"], dependencies=key_checked,
                                 route_class_override=BodyRoute)


def _install_info_routes(app: FastAPI, gateway: Gateway, key_checked: list,
                               check_model: Callable[[str | None], None]) -> None:
    config = gateway.config

    @app.get("/health")
    async def health() -> JSONResponse:
        engines = {role: len(gateway.registry.engines(role)) for role in ("prefill", "decode")}
        if engines["decode"] == 0:
            status = "no decode engine available"
        elif gateway.preprocessor.stuck:
            status = "every tokenizer thread is held by a request past --preprocess-timeout"
        else:
            status = "ok"
        return JSONResponse({"status": status, "engines": engines}, status_code=200 if status == "ok" else 503)

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)  # some load balancers probe so

    @app.get("/metrics", dependencies=key_checked)
    async def metrics() -> Response:
        await gateway.registry.refresh_stats()
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", dependencies=key_checked, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    def model_card() -> dict[str, Any]:
        return {"id": config.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "pdserve", "root": config.model, "parent": None,
                "max_model_len": gateway.registry.max_model_len()}

    @app.get("/v1/models", dependencies=key_checked)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=key_checked)
    async def retrieve_model(model: str) -> dict[str, Any]:  # the openai client's models.retrieve(); ids may hold "/"
        check_model(model)
        return model_card()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _installed_version()}
