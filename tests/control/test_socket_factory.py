"""open_socket: the one factory's options and CURVE, on sync and asyncio contexts alike."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from pdserve.control.errors import TransportError
from pdserve.control.keys import load_cluster_keys, write_cluster_keys
from pdserve.control.messages import StatsRequest
from pdserve.control.protocol import decode
from pdserve.control.schema import MAX_FRAME_BYTES
from pdserve.control.sockets import ClientSocket, open_socket


@pytest.mark.parametrize("kind,option,value", [(zmq.ROUTER, zmq.ROUTER_MANDATORY, None), (zmq.DEALER, zmq.IMMEDIATE, 1)])
def test_every_socket_gets_the_same_bounds(kind, option, value):
    opened = open_socket(kind, "tcp://127.0.0.1:0" if kind == zmq.ROUTER else "tcp://127.0.0.1:9",
                         bind=kind == zmq.ROUTER, hwm=7, linger_s=0.25)
    try:
        socket = opened.socket
        assert socket.getsockopt(zmq.MAXMSGSIZE) == MAX_FRAME_BYTES
        assert (socket.getsockopt(zmq.SNDHWM), socket.getsockopt(zmq.RCVHWM)) == (7, 7)
        assert socket.getsockopt(zmq.LINGER) == 250
        if value is not None:  # ROUTER_MANDATORY cannot be read back
            assert socket.getsockopt(option) == value
    finally:
        opened.close()


def test_a_bind_that_fails_names_the_address_and_the_fix():
    first = open_socket(zmq.ROUTER, "tcp://127.0.0.1:0", bind=True)
    try:
        with pytest.raises(TransportError, match=f"cannot bind {first.address}.*pick a free port"):
            open_socket(zmq.ROUTER, first.address, bind=True)
    finally:
        first.close()


def test_an_asyncio_server_admits_only_the_cluster_client_key(tmp_path):
    cluster = load_cluster_keys(write_cluster_keys(tmp_path / "ours"))
    stranger = load_cluster_keys(write_cluster_keys(tmp_path / "theirs"))
    # the stranger knows our server's public key, but its client key is not ours
    impostor = type(stranger.client)(stranger.client.keypair, cluster.client.server_public_key)

    async def scenario() -> list[str]:
        context = zmq.asyncio.Context()
        server = open_socket(zmq.ROUTER, "tcp://127.0.0.1:0", bind=True, curve=cluster.server, context=context)
        heard = []
        try:
            for name, keys in (("impostor", impostor), ("member", cluster.client)):
                with ClientSocket(server.address, curve=keys, send_timeout=0.5) as client:
                    try:
                        client.send(StatsRequest())
                    except TransportError:
                        continue  # the handshake never completed: nothing could be sent
                    try:
                        parts = await asyncio.wait_for(server.socket.recv_multipart(), timeout=1.0)
                    except asyncio.TimeoutError:
                        continue
                    decode(parts[1:])
                    heard.append(name)
        finally:
            server.close(linger_s=0)
            context.term()
        return heard

    assert asyncio.run(scenario()) == ["member"]
