"""The kubelet's probes cannot be crowded out, and a request must arrive whole within a
deadline (issue 20, defect 2).

Before the fix ``/health`` and ``/ready`` shared port 9400's 100 connections with
``/metrics``, and the read timeout was per ``recv``: 100 connections dribbling a byte now
and then held every place, each liveness probe got 503, and the kubelet restarted the agent.
Each test here failed on that code (the probes had no listener of their own, and a request
sent a byte every 0.25 s was served however long it took).
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from agent.config import Config, load_config, probe_address_of
from agent.errors import ConfigError
from agent.http.endpoints import MAX_CONNECTIONS, HttpEndpoints, WaitingEndpoint
from agent.http.probes import MAX_PROBE_CONNECTIONS

BODY = b"# TYPE up_test gauge\nup_test 1\n"


@pytest.fixture
def served():
    endpoints = HttpEndpoints(Config(metrics_address="127.0.0.1:0"), lambda: BODY, lambda: True)
    endpoints.start()
    yield endpoints
    endpoints.stop()


def get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def half_sent(port: int, count: int) -> list[socket.socket]:
    """``count`` connections, each having sent the start of a request and nothing more."""
    held = []
    for _ in range(count):
        conn = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        held.append(conn)
    return held


def test_probes_answer_while_slow_clients_hold_every_metrics_connection(served):
    held = half_sent(served.port, MAX_CONNECTIONS + 20)
    try:
        time.sleep(0.3)  # every place on the metrics port is taken...
        with socket.create_connection(("127.0.0.1", served.port), timeout=5) as extra:
            assert extra.recv(1024).startswith(b"HTTP/1.1 503")
        for _ in range(5):  # ...and the probes do not notice
            assert get(served.probe_port, "/health") == 200
            assert get(served.probe_port, "/ready") == 200
    finally:
        for conn in held:
            conn.close()


def test_probes_answer_while_slow_clients_flood_the_probe_port_itself(served):
    held = half_sent(served.probe_port, MAX_PROBE_CONNECTIONS + 44)
    try:
        for _ in range(5):
            assert get(served.probe_port, "/health") == 200
            assert get(served.probe_port, "/ready") == 200
    finally:
        for conn in held:
            conn.close()


def _dribble(port: int, request: bytes, outcome: dict[int, str]) -> None:
    """Send ``request`` a byte every 0.25 s; record whether the server hung up before it
    was whole, or answered it."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        try:
            for i in range(len(request)):
                conn.sendall(request[i:i + 1])
                time.sleep(0.25)
                conn.setblocking(False)
                try:
                    if conn.recv(1024) == b"":
                        outcome[port] = f"closed after {i + 1} of {len(request)} bytes"
                        return
                except BlockingIOError:
                    pass
                finally:
                    conn.setblocking(True)
            outcome[port] = "answered: " + conn.recv(1024).decode(errors="replace").split("\r\n")[0]
        except ConnectionError:
            outcome[port] = "closed (reset) before the request was whole"


def test_a_request_dribbled_byte_by_byte_past_the_deadline_is_dropped_on_both_ports(served):
    # 60 bytes at 4 a second take 15 s: past the deadline, each byte well within any
    # per-read timeout
    metrics = b"GET /metrics HTTP/1.1\r\nHost: x\r\nUser-Agent: slow-drip/1.0\r\n\r\n"
    probe = b"GET /health HTTP/1.1\r\nHost: x\r\nUser-Agent: slow-drip/1.0/probe\r\n\r\n"
    outcome: dict[int, str] = {}
    threads = [threading.Thread(target=_dribble, args=(served.port, metrics, outcome)),
               threading.Thread(target=_dribble, args=(served.probe_port, probe, outcome))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert outcome[served.port].startswith("closed"), outcome
    assert outcome[served.probe_port].startswith("closed"), outcome
    assert get(served.port, "/metrics") == 200 and get(served.probe_port, "/health") == 200


def test_a_prompt_keep_alive_client_is_served_request_after_request(served):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=5)
    try:
        for _ in range(3):
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            assert (response.status, response.read()) == (200, BODY)
    finally:
        conn.close()


def test_the_probe_port_answers_only_the_probes(served):
    assert get(served.probe_port, "/metrics") == 404
    with socket.create_connection(("127.0.0.1", served.probe_port), timeout=5) as conn:
        conn.sendall(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert conn.recv(1024).startswith(b"HTTP/1.1 405")
    with socket.create_connection(("127.0.0.1", served.probe_port), timeout=5) as conn:
        conn.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        assert conn.recv(1024).startswith(b"HTTP/1.1 400")
    with socket.create_connection(("127.0.0.1", served.probe_port), timeout=5) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\n" + b"X-Padding: " + b"a" * 10_000)
        assert conn.recv(1024).startswith(b"HTTP/1.1 431")


def test_readiness_on_the_probe_port_follows_the_agent():
    state = {"ready": False}
    endpoints = HttpEndpoints(Config(metrics_address="127.0.0.1:0"), lambda: BODY, lambda: state["ready"])
    endpoints.start()
    try:
        assert get(endpoints.probe_port, "/ready") == 503
        state["ready"] = True
        assert get(endpoints.probe_port, "/ready") == 200
    finally:
        endpoints.stop()


def test_health_on_both_ports_follows_whether_the_agent_can_serve():
    state = {"live": True}
    endpoints = HttpEndpoints(Config(metrics_address="127.0.0.1:0"), lambda: BODY, lambda: True,
                              lambda: state["live"])
    endpoints.start()
    try:
        assert (get(endpoints.probe_port, "/health"), get(endpoints.port, "/health")) == (200, 200)
        state["live"] = False  # a socket that could not be served for a while: restart the pod
        assert (get(endpoints.probe_port, "/health"), get(endpoints.port, "/health")) == (503, 503)
        state["live"] = True
        assert (get(endpoints.probe_port, "/health"), get(endpoints.port, "/health")) == (200, 200)
    finally:
        endpoints.stop()


def test_while_waiting_for_nvml_the_probe_port_says_alive_and_not_ready():
    waiting = WaitingEndpoint(Config(metrics_address="127.0.0.1:0"))
    waiting.start()
    try:
        assert get(waiting.probe_port, "/health") == 200
        assert get(waiting.probe_port, "/ready") == 503
        assert get(waiting.port, "/metrics") == 503
    finally:
        waiting.stop()


# ------------------------------------------------------------------ the setting
def test_the_probe_address_defaults_to_the_next_port_of_the_metrics_address():
    assert probe_address_of(Config()) == ":9401"
    assert probe_address_of(Config(metrics_address="10.0.0.5:9500")) == "10.0.0.5:9501"
    assert probe_address_of(Config(metrics_address="127.0.0.1:0")) == "127.0.0.1:0"
    assert probe_address_of(Config(probe_address=":8081")) == ":8081"


def test_the_probe_address_is_a_flag_an_environment_variable_and_a_config_field(tmp_path):
    (tmp_path / "c.yaml").write_text("version: v1\nmetrics:\n  probeAddress: ':7001'\n")
    assert load_config(str(tmp_path / "c.yaml"), {}, {}).probe_address == ":7001"
    env = {"PROBE_ADDRESS": ":7002"}
    assert load_config(str(tmp_path / "c.yaml"), env, {}).probe_address == ":7002"
    assert load_config(str(tmp_path / "c.yaml"), env, {"probe_address": ":7003"}).probe_address == ":7003"


def test_a_probe_address_on_the_metrics_port_or_malformed_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"probe_address ':9400': expected another port than metrics_address ':9400'"):
        load_config(None, {"PROBE_ADDRESS": ":9400"}, {})
    with pytest.raises(ConfigError, match=r"probe_address '127.0.0.1:9400'"):
        load_config(None, {}, {"probe_address": "127.0.0.1:9400"})
    with pytest.raises(ConfigError, match=r"probe_address 'nine': expected HOST:PORT"):
        load_config(None, {}, {"probe_address": "nine"})
