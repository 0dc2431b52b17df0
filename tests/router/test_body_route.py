"""A BodyRoute (the generation endpoints' route class) refuses a bad body exactly as FastAPI's own route
would: the same exception type, status, error types, locations and messages, for every kind of bad body;
and it runs the route's dependencies (the API key check) before reading the body."""


import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from starlette.exceptions import HTTPException

from pdserve.router.body_route import BodyRoute
from pdserve.router.schemas import ChatCompletionRequest, CompletionRequest


def app_with_both(model) -> FastAPI:
    app = FastAPI()

    async def echo(body, request: Request) -> JSONResponse:
        return JSONResponse(body.model_dump(mode="json", exclude_unset=True))

    @app.post("/fastapi")
    async def through_fastapi(body: model, request: Request) -> JSONResponse:  # type: ignore[valid-type]
        return await echo(body, request)

    async def through_body_route(body: model, request: Request) -> JSONResponse:  # type: ignore[valid-type]
        return await echo(body, request)

    app.router.add_api_route("/body-route", through_body_route, methods=["POST"], route_class_override=BodyRoute)

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
        routed = client.post("/body-route", content=body, headers=headers)
        fastapi = client.post("/fastapi", content=body, headers=headers)
        assert (routed.status_code, routed.json()) == (fastapi.status_code, fastapi.json()), body[:60]


def test_the_routes_dependencies_run_before_the_body_is_read():
    app = app_with_both(CompletionRequest)
    checked = []

    async def refuse(request: Request) -> None:
        checked.append(request.url.path)
        raise HTTPException(status_code=401, detail="no key")

    async def through_body_route(body: CompletionRequest, request: Request) -> JSONResponse:
        return JSONResponse({})

    app.router.add_api_route("/guarded", through_body_route, methods=["POST"], dependencies=[Depends(refuse)],
                             route_class_override=BodyRoute)
    answer = TestClient(app).post("/guarded", content=b'{"prompt": [1, 2', headers={"content-type": "application/json"})
    assert (answer.status_code, answer.json(), checked) == (401, {"kind": "http", "detail": "no key", "cause": None},
                                                           ["/guarded"])
    assert "/body-route" in app.openapi()["paths"] and "/guarded" in app.openapi()["paths"]  # listed as any route
