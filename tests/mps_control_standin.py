"""A stand-in for NVIDIA's ``nvidia-cuda-mps-control``, for tests that run the agent's MPS
supervisor without a GPU. It speaks the same command-line and standard-input protocol and
records what it was told.

Upstream behaviour it follows (nvidia-cuda-mps-control(1), NVIDIA's MPS documentation
"Tools and Interface Reference"):

* ``nvidia-cuda-mps-control -d`` starts the control daemon in the background and returns;
  the daemon writes its PID to ``nvidia-cuda-mps-control.pid`` in
  ``CUDA_MPS_PIPE_DIRECTORY`` and talks to clients through that directory. A second
  ``-d`` while one runs there fails (exit 1).
* ``nvidia-cuda-mps-control`` without arguments is a client: it reads commands from
  standard input, one per line, sends them to the daemon of ``CUDA_MPS_PIPE_DIRECTORY`` and
  prints the answers; without a daemon it prints an error and exits 1.
* Commands used here: ``set_default_active_thread_percentage <percent>``,
  ``get_default_active_thread_percentage`` (default 100.0), ``set_default_device_pinned_mem_limit
  <device> <value>``, ``get_default_device_pinned_mem_limit <device>``, ``quit`` (the daemon
  ends). An unknown command is an error.

Not upstream: the transport is a unix socket named ``control`` in the pipe directory (the
real one's is private), and the daemon appends JSON lines to ``standin.jsonl`` in
``CUDA_MPS_LOG_DIRECTORY``: ``{"start": {env}}`` when it starts, ``{"command": text}`` for
every command. Tests read that record and kill the daemon by its PID file.
"""

from __future__ import annotations

import json
import os
import socket
import sys

PID_FILE = "nvidia-cuda-mps-control.pid"
SOCKET = "control"
RECORD = "standin.jsonl"
ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


def _paths() -> tuple[str, str]:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    logs = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
    return pipe, logs


def _record(entry: dict) -> None:
    _, logs = _paths()
    with open(os.path.join(logs, RECORD), "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")


def _ask(line: str) -> str | None:
    """The daemon's answer to one command; None when no daemon answers."""
    pipe, _ = _paths()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(os.path.join(pipe, SOCKET))
            s.sendall(line.encode() + b"\n")
            s.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            return data.decode()
    except OSError:
        return None


def client() -> int:
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


def _answer(state: dict, line: str) -> tuple[bool, str]:
    words = line.split()
    if words == ["get_default_active_thread_percentage"]:
        return True, f"{state['threads']:.1f}"
    if len(words) == 2 and words[0] == "set_default_active_thread_percentage":
        state["threads"] = float(words[1])
        return True, f"{state['threads']:.1f}"
    if len(words) == 3 and words[0] == "set_default_device_pinned_mem_limit":
        state["memory"][words[1]] = words[2]
        return True, ""
    if len(words) == 2 and words[0] == "get_default_device_pinned_mem_limit":
        return True, state["memory"].get(words[1], "0")
    if words == ["quit"]:
        return True, ""
    return False, f"Unrecognized command: {line}"


def daemon_loop(server: socket.socket) -> None:
    pipe, _ = _paths()
    state: dict = {"threads": 100.0, "memory": {}}
    while True:
        conn, _ = server.accept()
        with conn:
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
            line = data.decode().strip()
            _record({"command": line})
            ok, text = _answer(state, line)
            conn.sendall(f"{'ok' if ok else 'error'} {text}".encode())
        if line == "quit":
            for name in (PID_FILE, SOCKET):
                try:
                    os.unlink(os.path.join(pipe, name))
                except OSError:
                    pass
            os._exit(0)


def start_daemon() -> int:
    pipe, logs = _paths()
    if _ask("get_default_active_thread_percentage") is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    os.makedirs(logs, exist_ok=True)
    path = os.path.join(pipe, SOCKET)
    if os.path.exists(path):
        os.unlink(path)  # left by a daemon that was killed
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    if os.fork() > 0:
        return 0  # the caller's "-d" returns once the daemon listens
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    with open(os.path.join(pipe, PID_FILE), "w", encoding="ascii") as fh:
        fh.write(f"{os.getpid()}\n")
    _record({"start": {k: os.environ.get(k) for k in ENV}, "environment": sorted(os.environ)})
    daemon_loop(server)
    return 0


def main(argv: list[str]) -> int:
    if argv == ["-d"]:
        return start_daemon()
    if not argv:
        return client()
    print(f"usage: nvidia-cuda-mps-control [-d]; got {' '.join(argv)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
