"""What live pages that never read cost a server (issue 60, item 3; appendix C).

A server with ``--watchers`` open views of ``/dashboard/events`` whose sockets are never read (a stalled phone, a
tab in the background), against the same server without them: how long one greedy request takes, and how long
``/health`` takes to answer while they are open and as they close. Runs on the CPU with the demo's model (SmolLM2)
unless ``--model`` says otherwise:

    PYTHONPATH=$PWD python scripts/probes/dashboard_watchers.py [--watchers 100] [--out FILE.json]

To measure an older checkout, put its package first on the path (``PYTHONPATH=old-checkout python -P ...``): the
server runs from the package this script imports.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from urllib.parse import urlsplit

import httpx

import nanovllm
from nanovllm.serve.process import ServerProcess


def timed_request(url: str, model: str, max_tokens: int) -> float:
    body = {"model": model, "prompt": "The history of the printing press", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    began = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - began


class HealthWatch:
    """Asks /health every 50 ms from a thread; keeps how long each answer took."""

    def __init__(self, url: str) -> None:
        self.url, self.seconds, self.stopped = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self.stopped.is_set():
                began = time.perf_counter()
                http.get(f"{self.url}/health")
                self.seconds.append(time.perf_counter() - began)
                time.sleep(0.05)

    def __enter__(self) -> HealthWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stopped.set()
        self.thread.join()


def open_watchers(url: str, count: int) -> list[socket.socket]:
    """``count`` views of the live page's events whose sockets are never read (a small receive buffer fills)."""
    parts = urlsplit(url)
    watchers = []
    for _ in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((parts.hostname, parts.port))
        sock.sendall(f"GET /dashboard/events HTTP/1.1\r\nHost: {parts.hostname}\r\n\r\n".encode())
        watchers.append(sock)
    return watchers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--watchers", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    server_args = ["--device", "cpu", *(["--model", args.model] if args.model else [])]
    with ServerProcess(server_args) as server:
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        timed_request(server.url, model, 4)  # warm up
        alone = [timed_request(server.url, model, args.max_tokens) for _ in range(args.repeats)]
        watchers = open_watchers(server.url, args.watchers)
        time.sleep(1.0)
        with HealthWatch(server.url) as open_health:
            watched = [timed_request(server.url, model, args.max_tokens) for _ in range(args.repeats)]
        with HealthWatch(server.url) as closing_health:
            for sock in watchers:
                sock.close()
            time.sleep(3.0)
    figures = {
        "package": nanovllm.__file__, "watchers": args.watchers, "max_tokens": args.max_tokens,
        "request s, no watchers (median)": statistics.median(alone),
        "request s, watchers open (median)": statistics.median(watched),
        "request time, watchers open / none": statistics.median(watched) / statistics.median(alone),
        "/health s while open (max)": max(open_health.seconds),
        "/health s as they close (max)": max(closing_health.seconds),
    }
    print(json.dumps(figures, indent=2))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            json.dump(figures, out, indent=2)


if __name__ == "__main__":
    main()
