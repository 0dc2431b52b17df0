"""KV connector throughput: pdserve's protocol + transport against raw pyzmq, same bytes, same sockets.

    python experiments/connector_throughput.py [--sizes-mib 1 4 16 64] [--total-mib 512] [--message-mib 4]
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
import statistics
import tempfile
import time
import zlib

import msgpack
import torch
import zmq

from pdserve.kvtransfer.payload import payload_checksum
from pdserve.planner.profile import kv_link
from pdserve.planner.profile.kv_link import HWM, MIB, WAIT_S, run_scenarios
from pdserve.prefill.kv_sender import MESSAGE_TARGET_BYTES

MODES = ("raw", "raw-one", "kv")


def request_count(size_mib: int, total_mib: int) -> int:
    return max(4, total_mib // size_mib)


def messages_per_request(mode: str, size_mib: int, message_mib: int) -> int:
    return 1 if mode == "raw-one" else max(1, math.ceil(size_mib / message_mib))


# ---- sender (P) ----

def send_raw(sock: zmq.Socket, peer: bytes, num_requests: int, num_messages: int, kv: torch.Tensor) -> None:
    header = msgpack.packb({"type": "kv_layer", "version": 1, "request_id": "r0", "nbytes": kv.nbytes})
    payload = memoryview(kv.view(torch.uint8).numpy()).cast("B")
    for _ in range(num_requests):
        for _ in range(num_messages):
            sock.send_multipart([peer, header, payload], copy=False)
        sock.send_multipart([peer, b"done"])


def raw_socket(kind: int) -> zmq.Socket:
    """A plain pyzmq socket with the baselines' high-water marks and linger."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.LINGER, 1000)
    return sock


def raw_router(address: str) -> zmq.Socket:
    sock = raw_socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # else a full HWM drops messages instead of waiting
    sock.bind(address)
    return sock


def send_any(index: int, scenario: tuple, address_queue, result_queue, curve) -> None:
    """One scenario's sender: pdserve's link (kv_link.send_scenario), or the raw baselines over plain pyzmq."""
    _, mode, size_mib, num_messages, num_requests, address = scenario
    if mode == "kv":
        kv_link.send_scenario(index, scenario, address_queue, result_queue, curve)
        return
    kv = kv_link.random_kv(size_mib * MIB // num_messages)  # made before the clock, as for pdserve's link
    sock = raw_router(address)
    address_queue.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    peer = sock.recv_multipart()[0]
    start, start_cpu, start_thread = time.perf_counter(), time.process_time(), time.thread_time()
    send_raw(sock, peer, num_requests, num_messages, kv)
    sock.recv_multipart()  # the receiver's final ack
    result_queue.put(("send", index, time.perf_counter() - start, time.process_time() - start_cpu,
                      time.thread_time() - start_thread))
    sock.close()


# ---- receiver (D) ----

def receive_raw(sock: zmq.Socket, num_requests: int) -> None:
    done = 0
    while done < num_requests:
        parts = sock.recv_multipart(copy=False)
        done += len(parts) == 1


def raw_dealer(address: str) -> zmq.Socket:
    sock = raw_socket(zmq.DEALER)
    sock.connect(address)
    return sock


def receive_any(index: int, scenario: tuple, address_queue, result_queue, curve) -> None:
    if scenario[1] == "kv":
        kv_link.receive_scenario(index, scenario, address_queue, result_queue, curve)
        return
    sock = raw_dealer(address_queue.get(timeout=WAIT_S))
    sock.send(b"start")
    start_cpu, start_thread = time.process_time(), time.thread_time()
    receive_raw(sock, scenario[4])
    result_queue.put(("recv", index, None, time.process_time() - start_cpu,
                      time.thread_time() - start_thread))
    sock.send(b"ack")
    sock.close()


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
        results = run_scenarios(scenarios, pin=not args.no_pin, curve=args.curve, send=send_any, receive=receive_any)
    print_table(summarize(scenarios, results), args)


if __name__ == "__main__":
    main()
