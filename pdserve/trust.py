"""Which keys a process runs with: the cluster's CURVE keys (`--curve-dir`), or plaintext only when the
operator says `--insecure` and every address is loopback. `pdserve up` makes keys on first start
(threat model: docs/serving/security.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_trust_args(parser: argparse.ArgumentParser, up: bool = False) -> None:
    made = " (default: keys made on first start under the pdserve cache)" if up else " (default: none; then pass --insecure)"
    parser.add_argument("--curve-dir", default=None,
                        help=f"CURVE keys from `pdserve keygen DIR`: every plane encrypted and only holders of "
                             f"the cluster's client key admitted{made}")
    parser.add_argument("--insecure", action="store_true",
                        help="no CURVE: plaintext planes any local process can join; loopback addresses only")


def is_loopback(address: str) -> bool:
    """tcp://127.x.x.x, [::1] or localhost, and ipc:// (a local file) stay on this machine."""
    scheme, _, rest = address.partition("://")
    if scheme == "ipc":
        return True
    from pdserve.control.heartbeat import is_loopback_host

    return is_loopback_host(rest.rpartition(":")[0].strip("[]"))


def check_addresses(addresses: list[str | None]) -> None:
    """Each address is tcp://host:port or ipc://path; else ValueError naming the fix (before any model loads)."""
    from pdserve.control.errors import TransportError
    from pdserve.control.sockets import validate_address

    for address in addresses:
        try:
            if address:
                validate_address(address, bind=True)  # the shape only: port 0 (any) is checked where it matters
        except TransportError as exc:
            raise ValueError(str(exc)) from None


def check_cluster_keys(curve_dir: str | None) -> None:
    """The keys in --curve-dir are readable and whole (both pairs), checked before any model loads."""
    from pdserve.control.errors import TransportError
    from pdserve.control.keys import load_cluster_keys

    try:
        if curve_dir:
            load_cluster_keys(curve_dir)
    except TransportError as exc:
        raise ValueError(f"--curve-dir {curve_dir}: {exc}") from None


def curve_dir_for(args: argparse.Namespace, addresses: list[str]) -> str | None:
    """args.curve_dir, or None for a plaintext process that --insecure allows; else ValueError naming the fix."""
    check_addresses(addresses)
    if args.curve_dir and args.insecure:
        raise ValueError("--curve-dir and --insecure contradict each other: pass one of them")
    if args.curve_dir:
        return args.curve_dir
    if not args.insecure:
        raise ValueError("no cluster keys: pass --curve-dir DIR (create it once with `pdserve keygen DIR` and give "
                         "it to every process), or --insecure for plaintext on loopback addresses only")
    exposed = [address for address in addresses if address and not is_loopback(address)]
    if exposed:
        raise ValueError(f"--insecure would speak plaintext on {', '.join(exposed)}, which other machines can "
                         f"reach: use --curve-dir DIR (`pdserve keygen DIR`), or loopback addresses")
    print("warning: --insecure: no CURVE on any plane; every local process can join this cluster", file=sys.stderr)
    return None


def default_cluster_keys() -> Path:
    """The cluster keys `pdserve up` uses unless told otherwise: made once, then reused."""
    from pdserve.control.keys import has_cluster_keys, write_cluster_keys
    from pdserve.demo_model import cache_dir

    directory = cache_dir() / "cluster-keys"
    if not has_cluster_keys(directory):
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_cluster_keys(directory)
    return directory
