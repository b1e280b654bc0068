"""Chapter kernels forked from one warm process (a zygote), instead of each importing torch and transformers again.

``python -m tools.book execute`` starts 76 kernels (38 chapters, once per language), and nearly every chapter
imports torch and transformers in its first cells: about 2 CPU-seconds a kernel. The zygote imports them (and
ipykernel) once; every kernel is a fork of it, with them already imported. Measured on a 2-core machine: 14 kernels
(7 chapters) 1 min 46 s -> 1 min 20 s; the whole book in a fresh-clone CI run 10 min 20 s -> 8 min 5 s.

jupyter_client starts a kernel by running its kernel spec's command and then watches that process: it polls it,
and it signals its process group to interrupt, terminate or kill the kernel. So the command here is a launcher, a
bare interpreter (``python -I -S``, no site-packages) that stands for the kernel:

- it hands the zygote its standard streams (as file descriptors), arguments, environment and working directory;
- the zygote forks; the child applies them, starts a session of its own (as jupyter_client's own launch does) and
  becomes an ipykernel;
- a signal the launcher gets is passed to the kernel's process group; the kernel's exit status becomes the
  launcher's (the zygote reaps the kernel and reports it);
- when the launcher dies (jupyter_client kills it with SIGKILL on ``shutdown_kernel(now=True)``), the kernel sees
  its socket close and kills its own process group, as the SIGKILL to the group would have.

What is imported before the fork must not depend on a chapter: nothing that reads ``TRITON_INTERPRET`` at import
(triton, the engine's kernels: chapters set it in their first cells) and no environment read at import that a
chapter's kernel changes (the zygote starts with the kernels' environment, all but the book's language, which
`nanovllm.book.lang` reads when a chapter asks for it). Why our own: jupyter_client's provisioners launch
processes, and no maintained package forks local kernels from a preloaded interpreter.

``Zygote`` starts one and writes a kernel spec named ``python3`` that launches through it; pass
``zygote.kernel_spec_manager`` to a ``KernelManager``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

# What each kernel would import anyway: the chapters' models and tokenizers, and the kernel itself.
PRELOAD = ("torch", "transformers", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "ipykernel.kernelapp", "ipywidgets")
# The signals jupyter_client sends a kernel's process group, passed on to the kernel's.
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
LENGTH = struct.Struct("!I")


# ---------------------------------------------------------------- the launcher (a bare interpreter, stdlib only)

def launch(address: str, kernel_args: list[str]) -> int:
    """Have the zygote at ``address`` fork a kernel with ``kernel_args``; stand for it until it exits."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(address)
    request = json.dumps({"args": kernel_args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [LENGTH.pack(len(request))], [0, 1, 2])
    conn.sendall(request)
    replies = conn.makefile("rb")
    json.loads(replies.readline())  # {"pid": ...}: the kernel runs

    def relay(signum: int, _frame: object) -> None:
        conn.sendall(b"%d\n" % signum)

    for signum in RELAYED:
        signal.signal(signum, relay)
    line = replies.readline()
    if not line:  # the zygote went away before the kernel ended
        return 1
    code = json.loads(line)["exit"]
    if code < 0:  # killed by a signal: end the same way, so that the status says so
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


# ---------------------------------------------------------------- the zygote

def serve(address: str, parent: int) -> tuple[socket.socket, dict]:
    """Preload, listen at ``address`` and fork a kernel per connection; returns only in a forked child.

    The zygote ends (SIGTERM) when ``parent``, the process that started it, does (Linux).
    """
    import ctypes
    import importlib
    import selectors

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        sys.exit(1)
    for module in PRELOAD:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen()
    # SIGCHLD wakes the loop through a pipe, so that the zygote reaps its kernels without a thread
    # (a fork of a process with threads may inherit a lock that no thread will release).
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    kernels: dict[int, socket.socket] = {}
    print("zygote: ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request = receive(conn)
                except (OSError, ValueError, struct.error):  # a launcher that died or spoke garbage: not our end
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    for fd in (wake_read, wake_write):
                        os.close(fd)
                    listener.close()
                    for other in kernels.values():
                        other.close()
                    return conn, request
                for fd in request["fds"]:
                    os.close(fd)
                reply(conn, {"pid": pid})
                kernels[pid] = conn
            else:
                os.read(wake_read, 512)
                reap(kernels)


def receive(conn: socket.socket) -> dict:
    """A launcher's request: its arguments, environment and directory, and the descriptors of its streams (closed
    here if the rest of the request does not come whole)."""
    header, fds, _, _ = socket.recv_fds(conn, LENGTH.size, 3)
    try:
        (length,) = LENGTH.unpack(header)
        body = b""
        while len(body) < length:
            chunk = conn.recv(length - len(body))
            if not chunk:
                raise ConnectionError("the launcher hung up mid-request")
            body += chunk
        return {**json.loads(body), "fds": fds}
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def reply(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # the launcher is gone (killed): nobody to tell
        pass


def reap(kernels: dict[int, socket.socket]) -> None:
    while kernels:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = kernels.pop(pid, None)
        if conn is not None:
            reply(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()


# ---------------------------------------------------------------- the forked child

def become_kernel(conn: socket.socket, request: dict) -> None:
    """Take the launcher's streams, environment and directory, and run an ipykernel with its arguments."""
    import threading

    # As ipykernel_launcher does: the directory that `python -m` put first on the path (the zygote's) is
    # not the kernel's (IPython adds the working directory back).
    if sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.setsid()
    for signum in RELAYED:
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=follow_launcher, args=(conn,), name="kernel-zygote-launcher", daemon=True).start()
    # ipykernel's poller ends a kernel whose parent is gone; its parent is the zygote, not the process named by
    # JPY_PARENT_PID (whose value the zygote's ipykernel read at import, without it). The zygote ends with
    # the book's process.
    sys.argv = ["ipykernel_launcher", *request["args"], f"--IPKernelApp.parent_handle={os.getppid()}"]
    from ipykernel import kernelapp

    kernelapp.launch_new_instance()


def follow_launcher(conn: socket.socket) -> None:
    """Pass the launcher's signals to this kernel's process group; kill the group when the launcher dies."""
    for line in conn.makefile("rb"):
        os.killpg(0, int(line))
    os.killpg(0, signal.SIGKILL)


# ---------------------------------------------------------------- the book's side

class Zygote:
    """A zygote for the kernels of one ``tools.book execute``, and a kernel spec that launches through it."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        import subprocess
        import tempfile

        from jupyter_client.kernelspec import KernelSpecManager

        self.folder = tempfile.TemporaryDirectory(prefix="book-zygote-")
        self.address = address = os.path.join(self.folder.name, "zygote")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tools.kernel_zygote", "serve", address, str(os.getpid())],
            env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        if self.process.stdout.readline() != b"zygote: ready\n":
            self.close()
            raise RuntimeError(f"the kernel zygote did not start (exit status {self.process.wait()})")
        spec = os.path.join(self.folder.name, "kernels", "python3")
        os.makedirs(spec)
        with open(os.path.join(spec, "kernel.json"), "w") as out:
            json.dump({"argv": [sys.executable, "-I", "-S", os.path.abspath(__file__), "launch", address,
                                "-f", "{connection_file}"],
                       "display_name": "Python 3 (forked from the book's zygote)", "language": "python",
                       "interrupt_mode": "signal"}, out)
        self.kernel_spec_manager = KernelSpecManager(kernel_dirs=[os.path.join(self.folder.name, "kernels")])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait()
        self.process.stdout.close()
        self.folder.cleanup()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


if __name__ == "__main__":
    if sys.argv[1] == "launch":
        sys.exit(launch(sys.argv[2], sys.argv[3:]))
    become_kernel(*serve(sys.argv[2], int(sys.argv[3])))
