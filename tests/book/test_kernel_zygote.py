"""tools/kernel_zygote.py: the book's kernels are forks of one warm process, and behave as kernels Jupyter launched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client.manager import KernelManager

from tests.beyond.test_21_serving import alive, wait_until
from tools.kernel_zygote import Zygote
from tools.tangle import ROOT


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    with Zygote(dict(os.environ), str(ROOT)) as started:
        yield started


@pytest.fixture
def kernel(zygote: Zygote, tmp_path: Path) -> Iterator[tuple[KernelManager, object]]:
    manager = KernelManager(kernel_name="python3", kernel_spec_manager=zygote.kernel_spec_manager,
                            transport="ipc", ip=str(tmp_path / "k"))
    manager.start_kernel(env={**os.environ, "ZYGOTE_TEST": "the kernel's own"}, cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=60)
    yield manager, client
    client.stop_channels()
    if manager.has_kernel:
        manager.shutdown_kernel(now=True)


def run(client, code: str) -> str:
    """What ``code`` printed in the kernel (its first error's name if it raised)."""
    printed = []
    reply = client.execute_interactive(code, timeout=60, output_hook=lambda message: printed.append(message))
    if reply["content"]["status"] == "error":
        return reply["content"]["ename"]
    return "".join(m["content"]["text"] for m in printed if m["msg_type"] == "stream")


def test_a_kernel_is_a_fork_with_the_launchers_environment_directory_and_a_session_of_its_own(kernel, tmp_path):
    _, client = kernel
    printed = run(client, "import os, sys\n"
                          "print('torch' in sys.modules, os.environ['ZYGOTE_TEST'], os.getcwd(),"
                          " os.getpgid(0) == os.getsid(0) == os.getpid())")
    # torch was imported before the first cell: the kernel is a fork of the zygote, which imported it
    assert printed.split() == ["True", "the", "kernel's", "own", str(tmp_path), "True"]


def test_an_interrupt_reaches_a_running_cell(kernel):
    manager, client = kernel
    sleeping = client.execute("import time\ntime.sleep(60)")
    time.sleep(1.0)
    manager.interrupt_kernel()
    reply = client.get_shell_msg(timeout=20)
    assert reply["parent_header"]["msg_id"] == sleeping and reply["content"]["ename"] == "KeyboardInterrupt"
    while client.get_iopub_msg(timeout=20)["content"].get("execution_state") != "idle":
        pass  # the interrupted cell's last messages, before the next cell's
    assert run(client, "print(6 * 7)") == "42\n"  # the kernel lives on


def test_killing_the_kernel_ends_it_and_what_it_started(kernel):
    manager, client = kernel
    pids = run(client, "import os, subprocess\n"
                       "child = subprocess.Popen(['sleep', '60'])\n"
                       "print(os.getpid(), child.pid)").split()
    kernel_pid, child_pid = map(int, pids)
    manager.shutdown_kernel(now=True)  # SIGKILL to the launcher's group, as to any kernel Jupyter launched
    assert wait_until(lambda: not alive(kernel_pid)) and wait_until(lambda: not alive(child_pid))


def test_the_launcher_exits_as_the_kernel_did(kernel):
    manager, client = kernel
    launcher = manager.provisioner.process
    client.execute("import os\nos._exit(3)")
    assert launcher.wait(timeout=20) == 3
    manager.cleanup_resources()


def test_a_launcher_that_hangs_up_mid_request_leaves_the_zygote_serving(zygote, tmp_path):
    import socket

    for garbage in (b"", b"\x00\x00\x00\x09{not json"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(zygote.address)
            conn.sendall(garbage)
    manager = KernelManager(kernel_name="python3", kernel_spec_manager=zygote.kernel_spec_manager,
                            transport="ipc", ip=str(tmp_path / "k"))
    manager.start_kernel()
    try:
        client = manager.client()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        assert run(client, "print(6 * 7)") == "42\n" and zygote.process.poll() is None
        client.stop_channels()
    finally:
        manager.shutdown_kernel(now=True)


def test_a_zygote_ends_with_the_process_that_started_it(tmp_path):
    script = ("import os, sys, time; sys.path.insert(0, sys.argv[1])\n"
              "from tools.kernel_zygote import Zygote\n"
              "zygote = Zygote(dict(os.environ), sys.argv[1])\n"
              "print(zygote.process.pid, flush=True)\n"
              "os.kill(os.getpid(), 9)\n")
    # Its folder (the socket, the kernel spec) is left behind, as a killed process leaves its temporary files
    starter = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    assert starter.returncode == -signal.SIGKILL
    zygote_pid = int(starter.stdout)
    assert wait_until(lambda: not alive(zygote_pid))
