"""What ZMQ CURVE costs on one connection, alone: a DEALER sends a message of N bytes to a ROUTER
on loopback, which answers 2 bytes; median and best round trip of ``--rounds``, plain ZMQ and
CURVE alternating (``--passes`` of each), with pyzmq's bundled libzmq. The TransferQueue store's
sockets are CURVE servers (compat quirk 15); this separates its per-message and per-byte cost
from everything else ``bench_data_plane.py --compare-plain-wire`` measures.

Usage: ``python benchmarks/bench_zmq_curve.py [--sizes 200 65536 4194304] [--rounds 200] [--passes 2]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import zmq


def round_trips(curve: bool, size: int, rounds: int) -> list[float]:
    server, client = zmq.curve_keypair(), zmq.curve_keypair()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    if curve:
        router.curve_server = True
        router.curve_secretkey = server[1]
        dealer.curve_serverkey = server[0]
        dealer.curve_publickey, dealer.curve_secretkey = client
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")

    def echo() -> None:
        for _ in range(rounds + 1):
            frames = router.recv_multipart(copy=False)
            router.send_multipart([frames[0], b"ok"])

    thread = threading.Thread(target=echo)
    thread.start()
    payload = os.urandom(size)
    dealer.send(payload)  # the handshake and a first message, untimed
    dealer.recv()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dealer.send(payload, copy=False)
        dealer.recv()
        times.append(time.perf_counter() - t0)
    thread.join()
    dealer.close(linger=0)
    router.close(linger=0)
    ctx.term()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[200, 65536, 4194304])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    print(f"libzmq {zmq.zmq_version()}, pyzmq {zmq.pyzmq_version()}, CURVE: {zmq.has('curve')}")
    print(f"{'bytes':>9} {'plain ms':>9} {'curve ms':>9} {'plain best':>10} {'curve best':>10} {'curve MB/s':>10}")
    for size in args.sizes:
        rounds = max(5, min(args.rounds, (64 << 20) // max(size, 1)))
        got: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.passes):
            for curve in (False, True):
                got[curve] += round_trips(curve, size, rounds)
        plain, curve = got[False], got[True]
        print(
            f"{size:>9} {statistics.median(plain) * 1e3:>9.3f} {statistics.median(curve) * 1e3:>9.3f}"
            f" {min(plain) * 1e3:>10.3f} {min(curve) * 1e3:>10.3f} {size / min(curve) / 1e6:>10.0f}"
        )
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
