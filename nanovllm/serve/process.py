"""A server in a child process, for tests, the chapter and the benchmark: started on a free port, stopped with a
signal, and never left behind (it also dies with the process that started it)."""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import nanovllm

URL_LINE = re.compile(r"serving .* at (http://\S+)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child, before exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: Linux only
    except (OSError, AttributeError):
        pass


class ServerProcess:
    """``python -m nanovllm.serve ARGS`` (or ``command``) as a child process.

    Our server is started with ``--port 0`` and says where it listens; another ``command`` (a peer such as
    ``transformers serve``) is given ``port`` and polled at ``/health``. Output goes to ``log`` (a file). `stop`
    sends SIGINT, as Ctrl-C would, and kills the process only if it has not ended after ``timeout`` seconds.
    """

    def __init__(self, args: list[str] = (), *, command: list[str] | None = None, port: int | None = None,
                 ready_timeout: float = 180.0) -> None:
        self.ours = command is None
        root = str(Path(nanovllm.__file__).resolve().parent.parent)  # the same package, in the child
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.command = [sys.executable, "-m", "nanovllm.serve", *args, "--port", "0"] if self.ours else command
        self.url = None if self.ours else f"http://127.0.0.1:{port}"
        self.ready_timeout = ready_timeout
        self.log = Path(tempfile.mkstemp(prefix="nanovllm-server-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        atexit.register(self.stop)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.process.returncode}:\n{self.output()}")
            if self.url is None:
                found = URL_LINE.search(self.output())
                self.url = found[1] if found else None
            if self.url is not None and self.healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server was not ready after {self.ready_timeout} s:\n{self.output()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 15.0) -> int | None:
        """Ask the server to stop (Ctrl-C); wait; kill it if it would not. Returns its exit status."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        atexit.unregister(self.stop)
        return process.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        self.log.unlink(missing_ok=True)
