"""The HTTP gateway: OpenAI-compatible API, tokenizer and chat template, engine discovery and routing.

    config.py        RouterConfig: every knob of one router process, frozen
    errors.py        APIError and OpenAI's JSON error shape
    schemas.py       pydantic models of the requests (completions, chat)
    tokenization.py  the model's tokenizer and chat template; prompts -> token ids
    link.py          EngineLink: one asyncio DEALER to one engine's control socket
    registry.py      EngineRegistry: registration, heartbeats, static engines, liveness
    policies.py      prefill / decode routing policies, the prefix index
    gateway.py       Gateway: the router's long-lived state (engines, policy, metrics, admission)
    specs.py         validated requests -> ChoiceSpecs (context length, SamplingParams, n x prompts)
    generation.py    one choice of one request: route, submit, relay, stop strings, retry, abort
    responses.py     OpenAI response and stream-chunk bodies
    streaming.py     serving one request: whole or as server-sent events; disconnects, 429, metrics
    api.py           the FastAPI routes and error handlers
    metrics.py       prometheus metrics (request histograms, per-engine gauges)
    server.py        run(): uvicorn on a pre-bound socket, the PDSERVE_READY line
    probe.py         `python -m pdserve.router.probe URL|ADDRESS`: health check for containers
"""
