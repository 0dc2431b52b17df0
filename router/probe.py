"""Health probe for containers and scripts; exit status 0 = healthy.

    python -m pdserve.router.probe http://127.0.0.1:8000/health   # the router answers 200 (a decode engine is routable)
    python -m pdserve.router.probe tcp://127.0.0.1:5600 --curve-dir /keys   # an engine answers StatsRequest
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

from pdserve.control.errors import WireError
from pdserve.control.keys import load_cluster_keys
from pdserve.control.messages import EngineStats, StatsRequest
from pdserve.control.sockets import ClientSocket


def probe_http(url: str, timeout: float) -> str | None:
    """None when healthy, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read()[:200]!r}"
    except OSError as exc:
        return f"cannot reach {url}: {exc}"


def probe_engine(address: str, timeout: float, curve_dir: str | None = None) -> str | None:
    curve = load_cluster_keys(curve_dir).client if curve_dir else None
    try:
        with ClientSocket(address, linger=0, curve=curve) as client:
            client.send(StatsRequest(), timeout=timeout)
            received = client.recv(timeout=timeout)
    except WireError as exc:
        return f"engine at {address}: {exc}"
    if received is None or not isinstance(received.msg, EngineStats):
        return f"engine at {address} did not answer StatsRequest within {timeout}s"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.router.probe", description=__doc__.splitlines()[0])
    parser.add_argument("target",
                        help="http(s)://.../health of a router, or tcp://host:port of an engine's control socket")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--curve-dir", default=None, help="the cluster's CURVE keys, when the engine runs with them")
    args = parser.parse_args(argv)
    if args.target.startswith(("http://", "https://")):
        problem = probe_http(args.target, args.timeout)
    else:
        problem = probe_engine(args.target, args.timeout, args.curve_dir)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
