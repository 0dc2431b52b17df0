"""`pdserve profile`'s KV link step: pdserve's own KV messages (KVLayer payloads with their checksums, then KVDone)
streamed from a sender process (the prefill engine's side, ServerSocket) to a receiver process (the decode engine's,
ClientSocket) that asked for them, each pinned to a core of its own; per scenario the sender's wall time from its
first send to the receiver's final ack, and the CPU both processes (and their sending and receiving threads) spent.
The payload is made before the clock starts, as an engine's KV is computed before it is sent.
experiments/connector_throughput.py sets the same link against raw pyzmq.

A scenario: (transport, mode, MiB per request, messages per request, requests, address); mode "kv" here.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import time

import torch

from pdserve.control.keys import CurveClientConfig, CurveServerConfig, generate_curve_keypair
from pdserve.control.sockets import ClientSocket, ServerSocket
from pdserve.kvtransfer.messages import KVAck, KVDone, KVLayer, KVWant
from pdserve.kvtransfer.payload import combine_checksums

MIB = 1 << 20
HWM = 8  # messages in flight per socket, as an engine would bound its memory
NUM_KV_HEADS, HEAD_DIM = 8, 128  # bf16: 4 KiB of K+V per token per layer
WAIT_S = 60.0


def messages_per_request(size_mib: int, message_mib: int) -> int:
    """A request's payload messages: equal parts of at most message_mib, as the prefill engine groups layers."""
    return max(1, math.ceil(size_mib / message_mib))


# ---- sender (P) ----

def random_kv(message_bytes: int) -> torch.Tensor:
    """[1, 2, T, H, D] bf16 of random values: real bytes (a zero-filled buffer would be served from
    the shared zero page)."""
    num_tokens = message_bytes // (2 * NUM_KV_HEADS * HEAD_DIM * 2)
    return torch.randn(1, 2, num_tokens, NUM_KV_HEADS, HEAD_DIM).to(torch.bfloat16)


def send_kv(server, peer: bytes, num_requests: int, num_messages: int, kv: torch.Tensor) -> None:
    num_tokens = kv.shape[2]  # kv [1, 2, T, H, D]: one message's layer group
    for index in range(num_requests):
        request_id, checksums = f"req-{index}", []
        for layer in range(num_messages):
            msg, payload = KVLayer.from_tensor(kv, request_id=request_id, layer_start=layer, token_start=0)
            server.send(peer, msg, payload, timeout=WAIT_S)
            checksums.append(msg.checksum)
        server.send(peer, KVDone(request_id=request_id, first_token=1, num_tokens=num_tokens,
                                 checksum=combine_checksums(checksums)), timeout=WAIT_S)


def pin_to_core(core: int | None) -> None:
    """Give this process one core of its own (None: let the OS place it), and torch one thread on it: a
    pool sized for the whole machine would share that core, and its idle workers may spin after each op."""
    if core is not None:
        os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)


def run_sender(scenarios, address_queue, result_queue, core, curve, send=None) -> None:
    """The sender process: each scenario in turn, by send (default: send_scenario, pdserve's link)."""
    pin_to_core(core)
    for index, scenario in enumerate(scenarios):
        (send or send_scenario)(index, scenario, address_queue, result_queue, curve)


def send_scenario(index: int, scenario: tuple, address_queue, result_queue, curve) -> None:
    _, _, size_mib, num_messages, num_requests, address = scenario
    kv = random_kv(size_mib * MIB // num_messages)  # made before the clock, as an engine's KV is computed
    link = ServerSocket(address, hwm=HWM, curve=curve and curve[0])
    address_queue.put(link.address)
    peer = link.recv(WAIT_S).peer_id
    start, start_cpu, start_thread = time.perf_counter(), time.process_time(), time.thread_time()
    send_kv(link, peer, num_requests, num_messages, kv)
    link.recv(WAIT_S)  # the receiver's final ack
    # (side, scenario, wall s, process CPU s incl. zmq's I/O thread, CPU s of the thread that sent)
    result_queue.put(("send", index, time.perf_counter() - start, time.process_time() - start_cpu,
                      time.thread_time() - start_thread))
    link.close()


# ---- receiver (D) ----

def receive_kv(client, num_requests: int) -> None:
    done, checksums = 0, []
    while done < num_requests:
        received = client.recv(WAIT_S)
        if isinstance(received.msg, KVLayer):
            received.msg.tensor(received.frames[0])  # [1, 2, T, H, D] bf16 view of the frame
            checksums.append(received.msg.checksum)
        elif isinstance(received.msg, KVDone):
            if combine_checksums(checksums) != received.msg.checksum:
                raise RuntimeError(f"{received.msg.request_id}: combined checksum mismatch")
            done, checksums = done + 1, []


def run_receiver(scenarios, address_queue, result_queue, core, curve, receive=None) -> None:
    """The receiver process: each scenario in turn, by receive (default: receive_scenario, pdserve's link)."""
    pin_to_core(core)
    for index, scenario in enumerate(scenarios):
        (receive or receive_scenario)(index, scenario, address_queue, result_queue, curve)


def receive_scenario(index: int, scenario: tuple, address_queue, result_queue, curve) -> None:
    num_requests = scenario[4]
    link = ClientSocket(address_queue.get(timeout=WAIT_S), hwm=HWM, curve=curve and curve[1])
    link.send(KVWant(request_id="bench", skip_tokens=0, num_tokens=1), timeout=WAIT_S)
    start_cpu, start_thread = time.process_time(), time.thread_time()
    receive_kv(link, num_requests)
    result_queue.put(("recv", index, None, time.process_time() - start_cpu, time.thread_time() - start_thread))
    link.send(KVAck(request_id="bench", ok=True), timeout=WAIT_S)
    link.close()


# ---- driver ----

def cores_for(pin: bool) -> tuple[int | None, int | None]:
    """(sender core, receiver core): two different cores this process may use, or (None, None)."""
    allowed = sorted(os.sched_getaffinity(0))
    return (allowed[0], allowed[1]) if pin and len(allowed) >= 2 else (None, None)


def curve_configs() -> tuple[CurveServerConfig, CurveClientConfig]:
    """Fresh CURVE keys: the sender as the server, the receiver as a client that knows its public key."""
    server, client = generate_curve_keypair(), generate_curve_keypair()
    return CurveServerConfig(server), CurveClientConfig(client, server.public_key)


def run_scenarios(scenarios: list[tuple], pin: bool = True, curve: bool = False, send=None, receive=None
                  ) -> list[tuple]:
    """Every scenario through a sender and a receiver process; curve: pdserve's link encrypted and authenticated
    with CURVE. send, receive: one scenario's side (run_sender's and run_receiver's), module-level functions."""
    ctx = mp.get_context("spawn")
    address_queue, result_queue = ctx.Queue(), ctx.Queue()
    sender_core, receiver_core = cores_for(pin)
    configs = curve_configs() if curve else None
    sender = ctx.Process(target=run_sender, args=(scenarios, address_queue, result_queue, sender_core, configs, send),
                         name="sender")
    receiver = ctx.Process(target=run_receiver, args=(scenarios, address_queue, result_queue, receiver_core, configs, receive),
                           name="receiver")
    sender.start()
    receiver.start()
    results = []
    while len(results) < 2 * len(scenarios):
        try:
            results.append(result_queue.get(timeout=1.0))
        except queue.Empty:
            failed = [p.name for p in (sender, receiver) if p.exitcode not in (None, 0)]
            if failed:
                sender.kill()
                receiver.kill()
                raise RuntimeError(f"{failed} process failed (its traceback is above)") from None
    sender.join(WAIT_S)
    receiver.join(WAIT_S)
    return results

