"""CURVE keys: key pairs, the server and client configurations of a socket, and the cluster's key files
(`pdserve keygen DIR` writes DIR/server.key and DIR/client.key, mode 0600; `--curve-dir DIR` reads them).

Every bound socket holds the cluster's server pair and admits only the cluster's client key; every
connecting socket holds the client pair and the server's public key. A process needs the directory's
secrets to join, and all traffic on every plane is encrypted."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from pdserve.control.errors import CurveUnavailableError, TransportError

Z85_KEY_LEN = 40
_FILES = {"server": "server.key", "client": "client.key"}


def require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveUnavailableError("CURVE was requested but this libzmq has no CURVE support: install the "
                                    "pyzmq wheel from PyPI (it bundles libsodium) or build libzmq with libsodium")


def _z85_key(key: bytes | str, name: str) -> bytes:
    key = key.encode() if isinstance(key, str) else bytes(key)
    if len(key) != Z85_KEY_LEN:
        raise TransportError(f"{name} is {len(key)} bytes: CURVE keys are {Z85_KEY_LEN}-character Z85 "
                             f"strings made by generate_curve_keypair()")
    return key


@dataclass(frozen=True)
class CurveKeyPair:
    public_key: bytes  # Z85, 40 characters
    secret_key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_key", _z85_key(self.public_key, "public_key"))
        object.__setattr__(self, "secret_key", _z85_key(self.secret_key, "secret_key"))


def generate_curve_keypair() -> CurveKeyPair:
    require_curve()
    public_key, secret_key = zmq.curve_keypair()
    return CurveKeyPair(public_key, secret_key)


@dataclass(frozen=True)
class CurveServerConfig:
    keypair: CurveKeyPair
    allowed_client_keys: frozenset[bytes] | None = None  # None: any client that knows our public key

    def __post_init__(self) -> None:
        if self.allowed_client_keys is not None:
            keys = frozenset(_z85_key(k, "allowed client key") for k in self.allowed_client_keys)
            object.__setattr__(self, "allowed_client_keys", keys)


@dataclass(frozen=True)
class CurveClientConfig:
    keypair: CurveKeyPair
    server_public_key: bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "server_public_key", _z85_key(self.server_public_key, "server_public_key"))


@dataclass(frozen=True)
class ClusterCurve:
    server: CurveServerConfig  # for bound sockets (engine control, KV link, router registration)
    client: CurveClientConfig  # for connecting sockets


def write_cluster_keys(directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in _FILES.values():
        pair = generate_curve_keypair()
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump({"public": pair.public_key.decode(), "secret": pair.secret_key.decode()}, handle)
    return directory


def cluster_keys_secret(name: str) -> str:
    """New cluster keys as a Kubernetes Secret manifest (JSON, which kubectl reads as YAML) whose files are
    what `pdserve keygen DIR` writes: `pdserve keygen --secret-manifest NAME | kubectl apply -f -`."""
    files = {}
    for filename in _FILES.values():
        pair = generate_curve_keypair()
        files[filename] = json.dumps({"public": pair.public_key.decode(), "secret": pair.secret_key.decode()})
    return json.dumps({"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": name},
                       "stringData": files}, indent=2)


def has_cluster_keys(directory: str | Path) -> bool:
    return all((Path(directory) / name).is_file() for name in _FILES.values())


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
