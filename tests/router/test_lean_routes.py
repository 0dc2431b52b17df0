"""The lean generation endpoints refuse a bad body exactly as FastAPI's own route would: the same
exception type, status, error types, locations and messages, for every kind of bad body."""


import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from starlette.exceptions import HTTPException
from starlette.routing import Route

from pdserve.router.lean_routes import lean_endpoint
from pdserve.router.schemas import ChatCompletionRequest, CompletionRequest


def app_with_both(model) -> FastAPI:
    app = FastAPI()

    async def echo(body, request: Request) -> JSONResponse:
        return JSONResponse(body.model_dump(mode="json", exclude_unset=True))

    @app.post("/fastapi")
    async def through_fastapi(body: model, request: Request) -> JSONResponse:  # type: ignore[valid-type]
        return await echo(body, request)

    app.router.routes.insert(0, Route("/lean", lean_endpoint(model, echo, None), methods=["POST"]))

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        errors = [(e["type"], list(e["loc"]), e["msg"], str(e.get("ctx", {}).get("error", ""))) for e in exc.errors()]
        return JSONResponse({"kind": "validation", "errors": errors}, status_code=422)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        cause = type(exc.__cause__).__name__ if exc.__cause__ else None
        return JSONResponse({"kind": "http", "detail": exc.detail, "cause": cause}, status_code=exc.status_code)

    return app


BODIES = [
    (b'{"prompt": [1, 2, 3], "max_tokens": 4}', "application/json"),
    (b'{"prompt": "hi", "max_tokens": 4, "temperature": 0.5, "stop": ["x"]}', "application/json; charset=utf-8"),
    (b'{"prompt": [1, 2', "application/json"),
    (b'', "application/json"),
    (b'{"prompt": "hi"}', None),
    (b'{"prompt": "hi"}', "text/plain"),
    (b'{"prompt": "hi"}', "application/vnd.api+json"),
    (b'{"prompt": 5, "max_tokens": "many"}', "application/json"),
    (b'[1, 2, 3]', "application/json"),
    (b'\xff\xfe{"prompt": "hi"}', "application/json"),
    (b'{"prompt": ' + b'[' * 5000 + b']' * 5000 + b'}', "application/json"),
    (b'{"prompt": "hi", "max_tokens": ' + b'9' * 5000 + b'}', "application/json"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "application/json"),
]


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_every_body_gets_fastapis_answer(model):
    client = TestClient(app_with_both(model))
    for body, content_type in BODIES:
        headers = {"content-type": content_type} if content_type else {}
        lean = client.post("/lean", content=body, headers=headers)
        fastapi = client.post("/fastapi", content=body, headers=headers)
        assert (lean.status_code, lean.json()) == (fastapi.status_code, fastapi.json()), body[:60]
