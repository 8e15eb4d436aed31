"""The demo's MPS control program: a stand-in for ``nvidia-cuda-mps-control`` where no GPU
driver is, so the demo can show the agent's MPS supervisor at work. Standard library only
(it starts once per command the agent sends). The demo runs it through a small script it
writes to its temporary directory and names with ``--mps-control-binary`` (the agent passes
a program only three variables, so the script carries the interpreter and import path).

Upstream behaviour it follows: ``nvidia-cuda-mps-control``'s command line and its
standard-input command protocol (nvidia-cuda-mps-control(1); NVIDIA's MPS documentation,
"Tools and Interface Reference"), as NVIDIA's ``mps-control-daemon`` of the device plugin
drives it:

* ``-d`` starts the control daemon in the background and returns; it serves the clients of
  ``CUDA_MPS_PIPE_DIRECTORY`` and keeps ``control.log`` in ``CUDA_MPS_LOG_DIRECTORY``
  (its start, every command with its result, its end). A second ``-d`` while one answers
  there fails (exit 1).
* Without arguments it is a client: it reads commands from standard input, one a line,
  sends each to the daemon of ``CUDA_MPS_PIPE_DIRECTORY`` and prints the answers; exit 1
  when no daemon answers or a command fails.
* Commands: ``set_default_active_thread_percentage <percent>`` and
  ``get_default_active_thread_percentage`` (default 100.0, printed with one decimal),
  ``set_default_device_pinned_mem_limit <device> <value>`` and
  ``get_default_device_pinned_mem_limit <device>``, ``quit`` (the daemon ends). Any other
  command is an error.

Not upstream: the daemon and its clients talk over a unix socket named ``control`` in the
pipe directory (the real transport is private to the driver), no MPS server is ever
started (no CUDA client comes), and the daemon also ends once its pipe directory is gone
(the demo's temporary directory removed), so none outlives the demo.
"""

from __future__ import annotations

import os
import socket
import sys
import time

SOCKET = "control"
LOG = "control.log"
#: How often an idle daemon checks that its pipe directory still exists (s).
IDLE_CHECK_S = 1.0


def _pipe_dir() -> str:
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")


def _log(text: str) -> None:
    logs = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(os.path.join(logs, LOG), "a", encoding="utf-8") as fh:
        fh.write(f"[{stamp} Control {os.getpid()}] {text}\n")


def _ask(command: str) -> str | None:
    """The daemon's answer (``ok <text>`` or ``error <text>``); None when none answers."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(os.path.join(_pipe_dir(), SOCKET))
            s.sendall(command.encode() + b"\n")
            s.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            return data.decode()
    except OSError:
        return None


def _client() -> int:
    status = 0
    for line in sys.stdin.read().splitlines():
        if not line.strip():
            continue
        answer = _ask(line.strip())
        if answer is None:
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        ok, _, text = answer.partition(" ")
        if text:
            print(text)
        if ok != "ok":
            status = 1
    return status


class _State:
    """The daemon's defaults, as the commands set them."""

    def __init__(self) -> None:
        self.threads = 100.0
        self.memory: dict[str, str] = {}

    def answer(self, command: str) -> tuple[bool, str]:
        words = command.split()
        if words == ["get_default_active_thread_percentage"]:
            return True, f"{self.threads:.1f}"
        if len(words) == 2 and words[0] == "set_default_active_thread_percentage":
            try:
                self.threads = float(words[1])
            except ValueError:
                return False, f"Invalid percentage: {words[1]}"
            return True, f"{self.threads:.1f}"
        if len(words) == 3 and words[0] == "set_default_device_pinned_mem_limit":
            self.memory[words[1]] = words[2]
            return True, ""
        if len(words) == 2 and words[0] == "get_default_device_pinned_mem_limit":
            return True, self.memory.get(words[1], "0")
        if words == ["quit"]:
            return True, ""
        return False, f"Unrecognized command: {command}"


def _serve(server: socket.socket, path: str) -> None:
    state = _State()
    server.settimeout(IDLE_CHECK_S)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if not os.path.exists(path):
                return
            continue
        with conn:
            conn.settimeout(5)
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
            command = data.decode(errors="replace").strip()
            ok, text = state.answer(command)
            _log(f"Cmd:{command}")
            _log(text if ok else f"error: {text}")
            conn.sendall(f"{'ok' if ok else 'error'} {text}".encode())
        if command == "quit":
            return


def _start_daemon() -> int:
    if _ask("get_default_active_thread_percentage") is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    path = os.path.join(_pipe_dir(), SOCKET)
    if os.path.exists(path):
        os.unlink(path)  # left by a daemon that was killed
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    if os.fork() > 0:
        return 0  # "-d" returns once the daemon listens
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        _log("Control daemon started")
        _serve(server, path)
        _log("Control daemon exiting")
    except OSError:
        pass  # the directories went away under it
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    os._exit(0)


def main(argv: list[str]) -> int:
    """``nvidia-cuda-mps-control [-d]``: the exit status."""
    if argv == ["-d"]:
        return _start_daemon()
    if not argv:
        return _client()
    print(f"usage: nvidia-cuda-mps-control [-d]; got {' '.join(argv)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
