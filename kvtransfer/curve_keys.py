"""Cluster CURVE keys on disk: one server key pair for every bound socket, one client key pair for
every connecting socket. Servers admit only the cluster's client key, so a process needs the
directory's secrets to join; all traffic on every link is encrypted.

    pdserve keygen DIR      # writes DIR/server.key and DIR/client.key (mode 0600)
    pdserve prefill|decode|router|up ... --curve-dir DIR
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.kvtransfer.errors import TransportError
from pdserve.kvtransfer.transport import CurveClientConfig, CurveKeyPair, CurveServerConfig, generate_curve_keypair

_FILES = {"server": "server.key", "client": "client.key"}


@dataclass(frozen=True)
class ClusterCurve:
    server: CurveServerConfig  # for bound sockets (engine control, KV link, router registration)
    client: CurveClientConfig  # for connecting sockets


def write_cluster_keys(directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for role, name in _FILES.items():
        pair = generate_curve_keypair()
        path = directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump({"public": pair.public_key.decode(), "secret": pair.secret_key.decode()}, handle)
    return directory


def _read_pair(path: Path) -> CurveKeyPair:
    try:
        data = json.loads(path.read_text())
        return CurveKeyPair(data["public"], data["secret"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TransportError(f"cannot read CURVE key file {path} ({exc}): create the directory with "
                             "`pdserve keygen DIR`") from exc


def load_cluster_keys(directory: str | Path) -> ClusterCurve:
    directory = Path(directory)
    server, client = (_read_pair(directory / name) for name in _FILES.values())
    return ClusterCurve(
        server=CurveServerConfig(server, allowed_client_keys=frozenset({client.public_key})),
        client=CurveClientConfig(client, server_public_key=server.public_key),
    )
