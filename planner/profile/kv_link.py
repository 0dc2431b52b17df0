"""KV connector throughput: pdserve's protocol + transport against raw pyzmq, same bytes, same sockets.

    python -m pdserve.planner.profile.kv_link [--sizes-mib 1 4 16 64] [--total-mib 512] [--message-mib 4]
                                         [--repeats 3] [--no-pin] [--curve]

For each transport (tcp loopback, ipc) and payload size S MiB per request, a sender process (P,
ROUTER) streams N requests to a receiver process (D, DEALER) that asked for them; N * S is about
--total-mib. Like the prefill engine, which groups layers into ~4 MiB messages
(prefill.kv_sender.MESSAGE_TARGET_BYTES), a request goes as ceil(S / --message-mib) payload messages
of equal size, then one done message. Three senders of the same bytes:
  raw      pyzmq send_multipart([peer, fixed header, payload], copy=False) in the same messages as
           pdserve; the receiver only counts. The baseline for the protocol's own cost.
  raw-one  the same, but the whole request in one message (what a naive sender does).
  kv       ServerSocket.send(KVLayer.from_tensor(...)) with a payload checksum per message, then KVDone;
           the receiver decodes and validates each header, checks frame length and checksum, rebuilds
           the bf16 tensor view, and checks KVDone's combined checksum.
Time runs on the sender from its first send to the receiver's final ack. Repeats rotate the order of
the three (to share machine noise fairly); medians are reported, with the CPU time both processes
spent per MiB and the single-core speed of payload_checksum (XXH3) and of zlib.crc32. A paired ratio
is the median of pdserve/raw over runs that ran back to back, which cancels slow drift of a shared
machine better than the ratio of two medians. By default sender and receiver each get a core of
their own (--no-pin lets the OS place them).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
import zlib

import msgpack
import torch
import zmq

from pdserve.kvtransfer.messages import KVAck, KVDone, KVLayer, KVWant
from pdserve.kvtransfer.payload import combine_checksums, payload_checksum
from pdserve.control.keys import CurveClientConfig, CurveServerConfig, generate_curve_keypair
from pdserve.control.sockets import ClientSocket, ServerSocket
from pdserve.prefill.kv_sender import MESSAGE_TARGET_BYTES

MIB = 1 << 20
HWM = 8  # messages in flight per socket, as an engine would bound its memory
NUM_KV_HEADS, HEAD_DIM = 8, 128  # bf16: 4 KiB of K+V per token per layer
WAIT_S = 60.0
MODES = ("raw", "raw-one", "kv")


def request_count(size_mib: int, total_mib: int) -> int:
    return max(4, total_mib // size_mib)


def messages_per_request(mode: str, size_mib: int, message_mib: int) -> int:
    return 1 if mode == "raw-one" else max(1, math.ceil(size_mib / message_mib))


# ---- sender (P) ----

def random_kv(message_bytes: int) -> torch.Tensor:
    """[1, 2, T, H, D] bf16 of random values: the same kind of bytes for both modes (a zero-filled
    buffer would be served from the shared zero page, flattering the raw baseline)."""
    num_tokens = message_bytes // (2 * NUM_KV_HEADS * HEAD_DIM * 2)
    return torch.randn(1, 2, num_tokens, NUM_KV_HEADS, HEAD_DIM).to(torch.bfloat16)


def send_raw(sock: zmq.Socket, peer: bytes, num_requests: int, num_messages: int, kv: torch.Tensor) -> None:
    header = msgpack.packb({"type": "kv_layer", "version": 1, "request_id": "r0", "nbytes": kv.nbytes})
    payload = memoryview(kv.view(torch.uint8).numpy()).cast("B")
    for _ in range(num_requests):
        for _ in range(num_messages):
            sock.send_multipart([peer, header, payload], copy=False)
        sock.send_multipart([peer, b"done"])


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


def raw_router(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # else a full HWM drops messages instead of waiting
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.bind(address)
    return sock


def pin_to_core(core: int | None) -> None:
    """Give this process one core of its own (None: let the OS place it), and torch one thread on it: a
    pool sized for the whole machine would share that core, and its idle workers may spin after each op."""
    if core is not None:
        os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)


def run_sender(scenarios, address_queue, result_queue, core, curve) -> None:
    pin_to_core(core)
    for index, (_, mode, size_mib, num_messages, num_requests, address) in enumerate(scenarios):
        kv = random_kv(size_mib * MIB // num_messages)  # made before the clock, as an engine's KV is computed
        raw = mode != "kv"
        link = raw_router(address) if raw else ServerSocket(address, hwm=HWM, curve=curve and curve[0])
        address_queue.put(link.getsockopt_string(zmq.LAST_ENDPOINT) if raw else link.address)
        peer = link.recv_multipart()[0] if raw else link.recv(WAIT_S).peer_id
        start, start_cpu, start_thread = time.perf_counter(), time.process_time(), time.thread_time()
        send = send_raw if raw else send_kv
        send(link, peer, num_requests, num_messages, kv)
        link.recv_multipart() if raw else link.recv(WAIT_S)  # the receiver's final ack
        # (side, scenario, wall s, process CPU s incl. zmq's I/O thread, CPU s of the thread that sent)
        result_queue.put(("send", index, time.perf_counter() - start, time.process_time() - start_cpu,
                          time.thread_time() - start_thread))
        link.close()


# ---- receiver (D) ----

def receive_raw(sock: zmq.Socket, num_requests: int) -> None:
    done = 0
    while done < num_requests:
        parts = sock.recv_multipart(copy=False)
        done += len(parts) == 1


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


def raw_dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    return sock


def run_receiver(scenarios, address_queue, result_queue, core, curve) -> None:
    pin_to_core(core)
    for index, (_, mode, _, _, num_requests, _) in enumerate(scenarios):
        address = address_queue.get(timeout=WAIT_S)
        raw = mode != "kv"
        link = raw_dealer(address) if raw else ClientSocket(address, hwm=HWM, curve=curve and curve[1])
        if raw:
            link.send(b"start")
        else:
            link.send(KVWant(request_id="bench", skip_tokens=0, num_tokens=1), timeout=WAIT_S)
        start_cpu, start_thread = time.process_time(), time.thread_time()
        receive_raw(link, num_requests) if raw else receive_kv(link, num_requests)
        result_queue.put(("recv", index, None, time.process_time() - start_cpu, time.thread_time() - start_thread))
        if raw:
            link.send(b"ack")
        else:
            link.send(KVAck(request_id="bench", ok=True), timeout=WAIT_S)
        link.close()


# ---- driver ----

def build_scenarios(args, ipc_dir: str) -> list[tuple]:
    scenarios = []
    for transport in ("tcp", "ipc"):
        for size_mib in args.sizes_mib:
            for repeat in range(args.repeats):
                shift = repeat % len(MODES)  # rotate the order: no mode always runs first
                for mode in MODES[shift:] + MODES[:shift]:
                    address = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{ipc_dir}/kv-{len(scenarios)}.sock"
                    scenarios.append((transport, mode, size_mib, messages_per_request(mode, size_mib, args.message_mib),
                                      request_count(size_mib, args.total_mib), address))
    return scenarios


def cores_for(pin: bool) -> tuple[int | None, int | None]:
    """(sender core, receiver core): two different cores this process may use, or (None, None)."""
    allowed = sorted(os.sched_getaffinity(0))
    return (allowed[0], allowed[1]) if pin and len(allowed) >= 2 else (None, None)


def curve_configs() -> tuple[CurveServerConfig, CurveClientConfig]:
    """Fresh CURVE keys: the sender as the server, the receiver as a client that knows its public key."""
    server, client = generate_curve_keypair(), generate_curve_keypair()
    return CurveServerConfig(server), CurveClientConfig(client, server.public_key)


def run_scenarios(scenarios: list[tuple], pin: bool = True, curve: bool = False) -> list[tuple]:
    """curve: pdserve's link encrypted and authenticated with CURVE (the raw baselines stay plain)."""
    ctx = mp.get_context("spawn")
    address_queue, result_queue = ctx.Queue(), ctx.Queue()
    sender_core, receiver_core = cores_for(pin)
    configs = curve_configs() if curve else None
    sender = ctx.Process(target=run_sender, args=(scenarios, address_queue, result_queue, sender_core, configs),
                         name="sender")
    receiver = ctx.Process(target=run_receiver, args=(scenarios, address_queue, result_queue, receiver_core, configs),
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


def mib_per_s(checksum, num_mib: int = 64, repeats: int = 4) -> float:
    """Best of `repeats` over a fresh random buffer, so memory, not cache, feeds the checksum."""
    buffer = torch.randint(0, 256, (num_mib * MIB,), dtype=torch.uint8).numpy()
    best = min(timed(checksum, buffer) for _ in range(repeats))
    return num_mib / best


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def summarize(scenarios: list[tuple], results: list[tuple]) -> dict[tuple, float]:
    """(transport, mode, size_mib) -> median MiB/s; (transport, mode, size_mib, "cpu") -> median CPU ms
    per MiB, sender + receiver; (transport, "kv/" + raw mode, size_mib) -> median of kv / raw over the
    runs of one repeat (back to back)."""
    wall_s, cpu_s = {}, {}
    for side, index, wall, cpu, _ in results:
        cpu_s[index] = cpu_s.get(index, 0.0) + cpu
        if side == "send":
            wall_s[index] = wall
    runs: dict[tuple, list[tuple[float, float]]] = {}
    for index, (transport, mode, size_mib, _, num_requests, _) in enumerate(scenarios):
        num_mib = num_requests * size_mib
        runs.setdefault((transport, mode, size_mib), []).append((num_mib / wall_s[index], 1000 * cpu_s[index] / num_mib))
    summary = {}
    for (transport, mode, size_mib), values in runs.items():
        summary[transport, mode, size_mib] = statistics.median(speed for speed, _ in values)
        summary[transport, mode, size_mib, "cpu"] = statistics.median(cpu for _, cpu in values)
        if mode != "kv":  # the i-th run of each mode belongs to the same repeat
            pairs = zip(runs[transport, "kv", size_mib], values)
            summary[transport, "kv/" + mode, size_mib] = statistics.median(kv[0] / raw[0] for kv, raw in pairs)
    return summary


def print_table(summary: dict[tuple, float], args) -> None:
    print(f"\n{'transport':<9} {'MiB/req':>7} {'msgs/req':>8} {'requests':>8} {'raw MiB/s':>10} {'raw-one MiB/s':>13}"
          f" {'pdserve MiB/s':>13} {'paired vs raw':>13} {'paired vs raw-one':>17} {'CPU ms/MiB raw / pdserve':>25}")
    for transport in ("tcp", "ipc"):
        for size in args.sizes_mib:
            raw, raw_one, kv = (summary[transport, mode, size] for mode in MODES)
            cpu = f"{summary[transport, 'raw', size, 'cpu']:.2f} / {summary[transport, 'kv', size, 'cpu']:.2f}"
            print(f"{transport:<9} {size:>7} {messages_per_request('kv', size, args.message_mib):>8}"
                  f" {request_count(size, args.total_mib):>8} {raw:>10.0f} {raw_one:>13.0f} {kv:>13.0f}"
                  f" {summary[transport, 'kv/raw', size]:>13.0%} {summary[transport, 'kv/raw-one', size]:>17.0%}"
                  f" {cpu:>25}")
    if args.curve:
        print("\npdserve's link is encrypted and authenticated with CURVE; raw and raw-one are plain.")
    print(f"\nraw = the same messages as pdserve ({args.message_mib} MiB at most); raw-one = one message per request. "
          f"CPU = sender + receiver process time (zmq I/O threads included). Median of {args.repeats} runs each; "
          f"paired = median of pdserve/raw over runs of the same repeat. One core: payload_checksum "
          f"{mib_per_s(payload_checksum):.0f} MiB/s, zlib.crc32 {mib_per_s(zlib.crc32):.0f} MiB/s "
          f"(zlib {zlib.ZLIB_RUNTIME_VERSION}).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--total-mib", type=int, default=512, help="about this many MiB per timed run")
    parser.add_argument("--message-mib", type=int, default=MESSAGE_TARGET_BYTES // MIB,
                        help="largest payload message; a request is split into equal messages up to this size "
                             "(default: what the prefill engine sends)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--curve", action="store_true",
                        help="encrypt and authenticate pdserve's link with CURVE (the raw baselines stay plain)")
    parser.add_argument("--no-pin", action="store_true",
                        help="let the OS place both processes (default: sender and receiver each get one core)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvb") as ipc_dir:
        scenarios = build_scenarios(args, ipc_dir)
        results = run_scenarios(scenarios, pin=not args.no_pin, curve=args.curve)
    print_table(summarize(scenarios, results), args)


if __name__ == "__main__":
    main()
