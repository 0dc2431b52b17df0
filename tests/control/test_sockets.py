"""ZeroMQ transport: real round trips over tcp loopback and ipc, bounded waits, CURVE, bad peers."""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest
import torch
import zmq

from pdserve.control.errors import PeerUnreachableError, ProtocolError, TransportError, TransportTimeout
from pdserve.control.keys import CurveClientConfig, CurveKeyPair, CurveServerConfig, generate_curve_keypair
from pdserve.control.messages import Error
from pdserve.control.protocol import encode
from pdserve.control.sockets import ClientSocket, ServerSocket, validate_address
from pdserve.kvtransfer.errors import ChecksumMismatchError
from pdserve.kvtransfer.messages import Hello, HelloAck, KVAck, KVLayer, KVWant

WAIT_S = 5.0  # generous bound for messages that must arrive; tests finish far sooner
needs_curve = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@pytest.fixture
def ipc_dir():
    directory = tempfile.mkdtemp(prefix="kvt")  # short: ipc paths are limited to 107 bytes
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(params=["tcp", "ipc"])
def address(request, ipc_dir):
    return "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{ipc_dir}/kv.sock"


def connected_pair(address: str, curve_server: CurveServerConfig | None = None,
                   curve_client: CurveClientConfig | None = None):
    """Server + client whose link is proven by one Hello; returns (server, client, client's peer_id)."""
    server = ServerSocket(address, curve=curve_server)
    client = ClientSocket(server.address, curve=curve_client)
    client.send(Hello(fingerprint={"num_layers": 2}, role="decode", engine_id="d0"), timeout=WAIT_S)
    received = server.recv(WAIT_S)
    assert received is not None and received.msg.engine_id == "d0"
    return server, client, received.peer_id


def random_kv(dtype: torch.dtype, num_tokens: int = 33) -> torch.Tensor:
    """[num_layers=3, 2, num_tokens, 4, 64] with random bit patterns."""
    numel = 3 * 2 * num_tokens * 4 * 64
    bits = torch.randint(0, 256, (numel * torch.finfo(dtype).bits // 8,), dtype=torch.uint8)
    return bits.view(dtype).view(3, 2, num_tokens, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_round_trip_is_bit_exact(address, dtype):
    server, client, peer_id = connected_pair(address)
    with server, client:
        client.send(KVWant(request_id="r1", skip_tokens=16, num_tokens=33))
        want = server.recv(WAIT_S)
        assert want.peer_id == peer_id and want.msg == KVWant(request_id="r1", skip_tokens=16, num_tokens=33)
        kv = random_kv(dtype)
        msg, payload = KVLayer.from_tensor(kv, request_id="r1", layer_start=0, token_start=16)
        server.send(peer_id, msg, payload)
        received = client.recv(WAIT_S)
        assert received.msg == msg
        tensor = received.msg.tensor(received.frames[0])
        assert tensor.dtype == dtype and tensor.shape == kv.shape
        assert torch.equal(tensor.view(torch.uint8), kv.view(torch.uint8))


def test_resolved_address_and_many_clients(address):
    server = ServerSocket(address)
    clients = [ClientSocket(server.address) for _ in range(3)]
    try:
        assert server.address.startswith(address.split(":")[0]) and not server.address.endswith(":*")
        for index, client in enumerate(clients):
            client.send(KVAck(request_id=f"r{index}", ok=True), timeout=WAIT_S)
        peers = {}
        for _ in clients:
            received = server.recv(WAIT_S)
            peers[received.msg.request_id] = received.peer_id
        assert len(set(peers.values())) == 3
        for request_id, peer_id in peers.items():  # each reply reaches the client that asked
            server.send(peer_id, KVAck(request_id=request_id, ok=True))
        assert [c.recv(WAIT_S).msg.request_id for c in clients] == ["r0", "r1", "r2"]
    finally:
        for client in clients:
            client.close()
        server.close()


def test_bad_message_is_reported_and_the_server_keeps_serving(ipc_dir):
    server, client, peer_id = connected_pair(f"ipc://{ipc_dir}/kv.sock")
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    try:
        raw.send_multipart([b"\xc1 not msgpack"])
        with pytest.raises(ProtocolError, match="not valid msgpack") as info:
            server.recv(WAIT_S)
        assert info.value.peer_id not in (None, peer_id)  # names the raw socket, not the good client
        server.send(info.value.peer_id, Error.from_exception(info.value))
        reply = Error.from_exception(info.value)
        assert raw.poll(int(WAIT_S * 1000)) and raw.recv_multipart()[0] == encode(reply)[0]
        client.send(KVAck(request_id="still-here", ok=True))
        assert server.recv(WAIT_S).msg.request_id == "still-here"
    finally:
        raw.close()
        client.close()
        server.close()


def test_flipped_byte_on_the_wire_fails_the_checksum(ipc_dir):
    server, client, peer_id = connected_pair(f"ipc://{ipc_dir}/kv.sock")
    with server, client:
        kv = random_kv(torch.bfloat16, num_tokens=4)
        msg, payload = KVLayer.from_tensor(kv, request_id="r7", layer_start=0, token_start=0)
        corrupted = bytearray(payload)
        corrupted[100] ^= 0x40
        client._socket.send_multipart([encode(msg, payload)[0], bytes(corrupted)])  # bypass encode's views
        with pytest.raises(ChecksumMismatchError) as info:
            server.recv(WAIT_S)
        assert info.value.request_id == "r7" and info.value.peer_id == peer_id


def test_recv_timeout_is_honored(address):
    server, client, _ = connected_pair(address)
    with server, client:
        for endpoint in (server, client):
            start = time.monotonic()
            assert endpoint.recv(0.2) is None
            assert 0.19 <= time.monotonic() - start < 2.0
        assert client.recv(0) is None
        with pytest.raises(ValueError, match="wait bound"):
            client.recv(None)
        with pytest.raises(ValueError, match="wait bound"):
            client.recv(-1)


def test_send_without_a_server_times_out(ipc_dir):
    with ClientSocket(f"ipc://{ipc_dir}/nobody.sock") as client:
        start = time.monotonic()
        with pytest.raises(TransportTimeout, match="within 200 ms"):
            client.send(KVAck(request_id="r", ok=True), timeout=0.2)
        assert time.monotonic() - start < 2.0
        assert issubclass(TransportTimeout, TimeoutError)


def test_send_to_a_stuck_peer_times_out(ipc_dir):
    server = ServerSocket(f"ipc://{ipc_dir}/kv.sock", hwm=2)
    client = ClientSocket(server.address, hwm=2)
    with server, client:
        client.send(KVAck(request_id="hello", ok=True))
        peer_id = server.recv(WAIT_S).peer_id
        kv = torch.zeros(1, 2, 256, 8, 128, dtype=torch.bfloat16)  # 1 MiB, sent 64 times without copying
        msg, payload = KVLayer.from_tensor(kv, request_id="r", layer_start=0, token_start=0)
        start = time.monotonic()
        with pytest.raises(TransportTimeout, match="within 200 ms"):
            for _ in range(64):  # the client never reads: the queues and socket buffers fill up
                server.send(peer_id, msg, payload, timeout=0.2)
        assert time.monotonic() - start < 5.0


def test_send_to_a_gone_peer_raises(address):
    server, client, peer_id = connected_pair(address)
    with server:
        with pytest.raises(PeerUnreachableError, match="not connected"):
            server.send(b"\x00never", HelloAck(ok=True))
        client.close()
        deadline = time.monotonic() + WAIT_S
        with pytest.raises(PeerUnreachableError):
            while time.monotonic() < deadline:  # the disconnect reaches the ROUTER asynchronously
                server.send(peer_id, HelloAck(ok=True))
                time.sleep(0.02)


def test_close_does_not_hang_with_undelivered_messages(ipc_dir):
    server, client, peer_id = connected_pair(f"ipc://{ipc_dir}/kv.sock")
    big = bytes(1 << 20)
    msg = KVLayer(request_id="r", layer_start=0, layer_end=1, token_start=0, num_tokens=1, dtype="uint8",
                  shape=(1, 2, 1, 1, 1 << 19), nbytes=1 << 20, checksum=0)
    for _ in range(20):  # the client never reads these
        server.send(peer_id, msg, big)
    start = time.monotonic()
    server.close()
    client.close()
    assert time.monotonic() - start < 3.0


@pytest.mark.parametrize("address, words", [
    ("http://127.0.0.1:5", ["tcp://", "ipc://"]),
    ("127.0.0.1:5600", ["must start with"]),
    ("tcp://127.0.0.1", ["host:port"]),
    ("tcp://127.0.0.1:99999", ["port '99999'"]),
    ("tcp://127.0.0.1:0", ["give the port"]),
    ("ipc://" + "x" * 200, ["shorter path"]),
])
def test_bad_addresses_are_named(address, words):
    with pytest.raises(TransportError) as info:
        ClientSocket(address)
    for word in words:
        assert word in str(info.value)


def test_validate_address_on_bind():
    assert validate_address("tcp://127.0.0.1:0", bind=True) == "tcp://127.0.0.1:*"
    assert validate_address("tcp://127.0.0.1:5600", bind=True) == "tcp://127.0.0.1:5600"
    with ServerSocket("tcp://127.0.0.1:0") as first, pytest.raises(TransportError, match="cannot bind"):
        ServerSocket(first.address)


# ---- CURVE ----

@needs_curve
def test_curve_pair_talks(address):
    server_keys, client_keys = generate_curve_keypair(), generate_curve_keypair()
    server, client, peer_id = connected_pair(
        address, curve_server=CurveServerConfig(server_keys),
        curve_client=CurveClientConfig(client_keys, server_keys.public_key))
    with server, client:
        kv = random_kv(torch.bfloat16, num_tokens=2)
        msg, payload = KVLayer.from_tensor(kv, request_id="r", layer_start=0, token_start=0)
        server.send(peer_id, msg, payload)
        received = client.recv(WAIT_S)
        assert torch.equal(received.msg.tensor(received.frames[0]).view(torch.int16), kv.view(torch.int16))


@needs_curve
def test_curve_wrong_server_key_does_not_get_through():
    server_keys, client_keys, impostor = generate_curve_keypair(), generate_curve_keypair(), generate_curve_keypair()
    with ServerSocket("tcp://127.0.0.1:0", curve=CurveServerConfig(server_keys)) as server:
        with ClientSocket(server.address, curve=CurveClientConfig(client_keys, impostor.public_key)) as client:
            with pytest.raises(TransportTimeout):
                client.send(KVAck(request_id="r", ok=True), timeout=0.5)
            assert server.recv(0.3) is None
        with ClientSocket(server.address) as plain, pytest.raises(TransportTimeout):  # no CURVE at all
            plain.send(KVAck(request_id="r", ok=True), timeout=0.3)


@needs_curve
def test_curve_allow_list_admits_only_listed_clients():
    server_keys, allowed, stranger = generate_curve_keypair(), generate_curve_keypair(), generate_curve_keypair()
    config = CurveServerConfig(server_keys, allowed_client_keys=frozenset([allowed.public_key]))
    with ServerSocket("tcp://127.0.0.1:0", curve=config) as server:
        stranger_config = CurveClientConfig(stranger, server_keys.public_key)
        with ClientSocket(server.address, curve=stranger_config) as client, pytest.raises(TransportTimeout):
            client.send(KVAck(request_id="stranger", ok=True), timeout=0.5)
        with ClientSocket(server.address, curve=CurveClientConfig(allowed, server_keys.public_key)) as client:
            client.send(KVAck(request_id="friend", ok=True), timeout=WAIT_S)
            assert server.recv(WAIT_S).msg.request_id == "friend"
        assert server.recv(0.2) is None


def test_curve_keys_are_checked():
    with pytest.raises(TransportError, match="40-character Z85"):
        CurveKeyPair(b"short", b"x" * 40)
    keys = CurveKeyPair("a" * 40, "b" * 40)
    assert keys.public_key == b"a" * 40 and "bbbb" not in repr(keys)  # the secret never shows in logs
