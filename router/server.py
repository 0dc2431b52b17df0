"""run(config): the router's HTTP server (uvicorn) on a socket bound before it starts, so port 0
works and the PDSERVE_READY line names the real address:

    PDSERVE_READY role=router url=http://127.0.0.1:8000 registration=tcp://127.0.0.1:7000

The registration socket is bound before the tokenizer loads, and a line on stderr names it then, so a
launcher (`pdserve up`) can start engines while the router loads:

    PDSERVE_REGISTRATION registration=tcp://127.0.0.1:7000

uvicorn runs on uvloop with the httptools parser (both dependencies of pdserve; uvicorn's "auto" falls
back to asyncio and h11 where they are missing).
"""

from __future__ import annotations

import errno
import logging
import socket
import sys

import uvicorn

from pdserve.router.api import create_app
from pdserve.router.config import RouterConfig, open_api_warning
from pdserve.router.gateway import Gateway
from pdserve.router.header_deadline import HeaderDeadlineProtocol
from pdserve.router.registry import EngineRegistry

log = logging.getLogger("pdserve.router")


def bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    # without it every streamed chunk waits ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        fix = ("pick a free --port (0 = any)" if exc.errno in (errno.EADDRINUSE, errno.EACCES)
               else "give --host an address of this machine (127.0.0.1, or 0.0.0.0 for every interface)")
        raise ValueError(f"cannot listen on {host}:{port} ({exc}): {fix}") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def warn_if_open(config: RouterConfig, port: int) -> None:
    """No API key on an address other machines (or containers) can reach: say so once, at start."""
    warning = open_api_warning(config.host, port, config.api_key)
    if warning:
        log.warning(warning)


def build_gateway(config: RouterConfig) -> Gateway:
    """The gateway, its registration socket bound (and named on stderr) before the tokenizer loads: engines
    started meanwhile register then, and are reached once the server runs. A bad model fails here, before READY."""
    registry = EngineRegistry(config)
    registry.bind()
    if registry.registration_address:
        print(f"PDSERVE_REGISTRATION registration={registry.registration_address}", file=sys.stderr, flush=True)
    try:
        return Gateway(config, registry=registry)
    except BaseException:
        registry.unbind()
        raise


def run(config: RouterConfig) -> int:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s router %(name)s %(levelname)s %(message)s")
    sock = bind_http(config.host, config.port)
    port = sock.getsockname()[1]
    gateway = build_gateway(config)
    warn_if_open(config, port)

    def ready(gateway: Gateway) -> None:
        address = gateway.registry.registration_address
        registration = f" registration={address}" if address else ""
        print(f"PDSERVE_READY role=router url={_url(config.host, port)}{registration}", flush=True)

    app = create_app(config, gateway, on_started=[ready])
    # proxy_headers off: the router uses no client address (no access log), so X-Forwarded-* would be
    # parsed for nothing on every request
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level.lower(), access_log=False,
                                           proxy_headers=False, timeout_graceful_shutdown=5, lifespan="on",
                                           http=HeaderDeadlineProtocol))
    server.run(sockets=[sock])
    return 0
