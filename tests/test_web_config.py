"""Metrics over TLS with basic auth (issue 18): exporter-toolkit's web configuration
(``--web-config-file``), certificates rotated under a running agent, bad configurations
refused at start, and the probes left plain and open whatever the web configuration says.

Certificates are made at test time with ``openssl`` (tests/tls_support.py); the Prometheus
test runs Debian's ``prometheus`` as tests/test_prometheus.py does.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest
import yaml
from test_prometheus import PrometheusServer, needs_prometheus
from tls_support import OPENSSL, Pki, SecretVolume, basic, https_get, needs_openssl, peer_serial

from agent.config import Config, load_config
from agent.errors import ConfigError
from agent.http.endpoints import HttpEndpoints
from agent.http.webconfig import load_web_config

ROOT = Path(__file__).resolve().parent.parent
BODY = b"# TYPE up_test gauge\nup_test 1\n"


def hashed(password: str) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if OPENSSL is None:
        pytest.skip("openssl command not installed (Debian package 'openssl'): no test certificates")
    pki = Pki(tmp_path_factory.mktemp("pki"))
    pki.server_a = pki.issue("server-a", 0xA1)
    pki.server_b = pki.issue("server-b", 0xB2)
    pki.client = pki.issue("client", 0xC3, client=True)
    return pki


@pytest.fixture
def endpoints():
    """Start HttpEndpoints on free ports with the web config given; all stopped after."""
    made: list[HttpEndpoints] = []

    def start(web_config: Path | None, ready: bool = True) -> HttpEndpoints:
        config = Config(metrics_address="127.0.0.1:0", web_config_file=str(web_config or ""))
        served = HttpEndpoints(config, lambda: BODY, lambda: ready)
        served.start()
        made.append(served)
        return served

    yield start
    for served in made:
        served.stop()


def write_web_config(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def tls_and_users(cert: Path, key: Path, **tls) -> dict:
    return {"tls_server_config": {"cert_file": str(cert), "key_file": str(key), **tls},
            "basic_auth_users": {"prometheus": hashed("s3cret"), "alice": hashed("wonderland")}}


def plain_get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


# ------------------------------------------------------------------ basic auth over TLS
@needs_openssl
def test_scrapes_need_the_right_user_and_password_else_401_with_a_basic_challenge(pki, tmp_path, endpoints):
    served = endpoints(write_web_config(tmp_path / "web.yaml", tls_and_users(*pki.server_a)))
    client = pki.client_context()
    status, headers, body = https_get(served.port, client, headers=basic("prometheus", "s3cret"))
    assert (status, body) == (200, BODY)
    for credentials in ({}, basic("prometheus", "wrong"), basic("mallory", "s3cret"), {"Authorization": "Bearer x"}):
        status, headers, _ = https_get(served.port, client, headers=credentials)
        assert status == 401, credentials
        assert headers["WWW-Authenticate"] == "Basic"
    # cached answers keep their meaning: the right password again, the wrong one again
    assert https_get(served.port, client, headers=basic("prometheus", "s3cret"))[0] == 200
    assert https_get(served.port, client, headers=basic("prometheus", "wrong"))[0] == 401


@needs_openssl
def test_the_metrics_port_speaks_only_tls_when_the_web_config_has_a_certificate(pki, tmp_path, endpoints):
    served = endpoints(write_web_config(tmp_path / "web.yaml", tls_and_users(*pki.server_a)))
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as conn:
        conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            reply = conn.recv(4096)
        except ConnectionResetError:
            reply = b""
    assert b"up_test" not in reply  # the handshake fails: no metrics in clear


@needs_openssl
def test_a_tls_handshake_dribbled_byte_by_byte_is_dropped_at_the_request_deadline(pki, tmp_path, endpoints):
    served = endpoints(write_web_config(tmp_path / "web.yaml", tls_and_users(*pki.server_a)))
    hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(49))  # a ClientHello's start, 60 bytes
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as conn:
        sent = 0
        try:
            for i in range(len(hello)):  # 15 s at 4 bytes a second: past the 5 s deadline
                conn.sendall(hello[i:i + 1])
                sent += 1
                time.sleep(0.25)
                conn.setblocking(False)
                try:
                    if conn.recv(1024) == b"":
                        break
                except BlockingIOError:
                    pass
                finally:
                    conn.setblocking(True)
        except ConnectionError:
            pass
    assert sent < len(hello), "the server waited for the whole dribbled handshake"


@needs_openssl
def test_probes_stay_plain_http_and_need_no_credentials_whatever_the_web_config_says(pki, tmp_path, endpoints):
    served = endpoints(write_web_config(tmp_path / "web.yaml", tls_and_users(*pki.server_a)), ready=True)
    assert plain_get(served.probe_port, "/health") == 200
    assert plain_get(served.probe_port, "/ready") == 200
    assert plain_get(served.probe_port, "/metrics") == 404  # the probe port serves no metrics
    # on the metrics port, /health is behind the same TLS and authentication as /metrics
    assert https_get(served.port, pki.client_context(), "/health")[0] == 401


@needs_openssl
def test_configured_response_headers_are_sent(pki, tmp_path, endpoints):
    doc = tls_and_users(*pki.server_a)
    doc["http_server_config"] = {"headers": {"X-Frame-Options": "deny", "X-Content-Type-Options": "nosniff"}}
    served = endpoints(write_web_config(tmp_path / "web.yaml", doc))
    _, headers, _ = https_get(served.port, pki.client_context(), headers=basic("alice", "wonderland"))
    assert headers["X-Frame-Options"] == "deny" and headers["X-Content-Type-Options"] == "nosniff"


def test_basic_auth_without_tls_works_over_plain_http(tmp_path, endpoints):
    served = endpoints(write_web_config(tmp_path / "web.yaml", {"basic_auth_users": {"p": hashed("pw")}}))
    request = urllib.request.Request(f"http://127.0.0.1:{served.port}/metrics", headers=basic("p", "pw"))
    with urllib.request.urlopen(request, timeout=5) as r:
        assert r.read() == BODY
    assert plain_get(served.port, "/metrics") == 401


# ------------------------------------------------------------------ client certificates and versions
@needs_openssl
def test_require_and_verify_client_cert_admits_only_clients_with_a_certificate_of_the_ca(pki, tmp_path, endpoints):
    doc = {"tls_server_config": {"cert_file": str(pki.server_a[0]), "key_file": str(pki.server_a[1]),
                                 "client_auth_type": "RequireAndVerifyClientCert",
                                 "client_ca_file": str(pki.ca_cert)}}
    served = endpoints(write_web_config(tmp_path / "web.yaml", doc))
    assert https_get(served.port, pki.client_context(pki.client))[0] == 200
    with pytest.raises((ssl.SSLError, ConnectionError)):
        https_get(served.port, pki.client_context())  # no client certificate
    stranger = Pki(tmp_path / "other")  # a certificate from another CA
    foreign = stranger.issue("foreign", 7, client=True)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        https_get(served.port, pki.client_context(foreign))


@needs_openssl
def test_min_version_tls13_turns_away_a_tls12_client(pki, tmp_path, endpoints):
    doc = {"tls_server_config": {"cert_file": str(pki.server_a[0]), "key_file": str(pki.server_a[1]),
                                 "min_version": "TLS13"}}
    served = endpoints(write_web_config(tmp_path / "web.yaml", doc))
    old = pki.client_context()
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises((ssl.SSLError, ConnectionError)):
        https_get(served.port, old)
    assert https_get(served.port, pki.client_context())[0] == 200


# ------------------------------------------------------------------ rotation
@needs_openssl
def test_a_rotated_certificate_reaches_the_next_connection_and_a_request_in_flight_completes(pki, tmp_path, endpoints):
    secret = SecretVolume(tmp_path / "tls", *pki.server_a)
    served = endpoints(write_web_config(tmp_path / "web.yaml", tls_and_users(secret.cert, secret.key)))
    client = pki.client_context()
    assert peer_serial(served.port, client) == "A1"
    in_flight = client.wrap_socket(socket.create_connection(("127.0.0.1", served.port), timeout=10),
                                   server_hostname="127.0.0.1")
    try:
        assert in_flight.getpeercert()["serialNumber"] == "A1"
        request = (b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n"
                   + f"Authorization: {basic('prometheus', 's3cret')['Authorization']}\r\n\r\n".encode())
        in_flight.sendall(request[:20])  # the scrape has begun...
        secret.rotate(*pki.server_b)  # ...when cert-manager's renewal lands
        assert peer_serial(served.port, client) == "B2"  # the next connection gets the new one
        in_flight.sendall(request[20:])
        reply = b""
        while chunk := in_flight.recv(65536):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(BODY)
    finally:
        in_flight.close()
    assert https_get(served.port, client, headers=basic("prometheus", "s3cret"))[0] == 200


@needs_openssl
def test_a_changed_password_applies_to_the_next_connection_without_a_restart(pki, tmp_path, endpoints):
    path = write_web_config(tmp_path / "web.yaml", tls_and_users(*pki.server_a))
    served = endpoints(path)
    client = pki.client_context()
    assert https_get(served.port, client, headers=basic("prometheus", "s3cret"))[0] == 200
    doc = tls_and_users(*pki.server_a)
    doc["basic_auth_users"] = {"prometheus": hashed("n3w")}
    write_web_config(tmp_path / "web.new", doc).rename(path)
    assert https_get(served.port, client, headers=basic("prometheus", "s3cret"))[0] == 401
    assert https_get(served.port, client, headers=basic("prometheus", "n3w"))[0] == 200


@needs_openssl
def test_a_broken_web_config_mid_run_keeps_the_last_good_one_and_says_so_once(pki, tmp_path, endpoints, caplog):
    path = write_web_config(tmp_path / "web.yaml", tls_and_users(*pki.server_a))
    served = endpoints(path)
    client = pki.client_context()
    with caplog.at_level(logging.ERROR, logger="agent.metrics"):
        path.write_text("tls_server_config:\n  cert_file: [not, a, path]\n")
        for _ in range(3):
            assert https_get(served.port, client, headers=basic("alice", "wonderland"))[0] == 200
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert str(path) in errors[0] and "tls_server_config.cert_file" in errors[0]
    assert "keeping the configuration in force" in errors[0]


# ------------------------------------------------------------------ bad configurations
def _bad_configs(pki_dir: Path, cert: Path, key: Path, other_key: Path) -> list[tuple[dict | str, str]]:
    tls = {"cert_file": str(cert), "key_file": str(key)}
    return [
        ({"tls_sever_config": tls}, r"tls_sever_config: unknown key"),
        ({"tls_server_config": {**tls, "client_auth_type": "Sometimes"}},
         r"tls_server_config\.client_auth_type: expected one of NoClientCert, .*got 'Sometimes'"),
        ({"tls_server_config": {**tls, "client_auth_type": "RequireAnyClientCert"}},
         r"tls_server_config\.client_auth_type: RequireAnyClientCert .* not supported"),
        ({"tls_server_config": {**tls, "min_version": "TLS9"}}, r"tls_server_config\.min_version: expected one of TLS10"),
        ({"tls_server_config": {**tls, "min_version": "TLS13", "max_version": "TLS12"}},
         r"tls_server_config\.min_version: TLS13 is above max_version TLS12"),
        ({"tls_server_config": {"cert_file": str(cert)}}, r"tls_server_config\.key_file: missing"),
        ({"tls_server_config": {**tls, "cert_file": str(pki_dir / "absent.crt")}},
         r"tls_server_config\.cert_file: cannot read .*absent\.crt: No such file"),
        ({"tls_server_config": {**tls, "key_file": str(other_key)}},
         r"tls_server_config\.key_file: .* is not the key of cert_file"),
        ({"tls_server_config": {**tls, "cert_file": str(key)}}, r"tls_server_config\.cert_file: .* holds no PEM certificate"),
        ({"tls_server_config": {**tls, "client_ca_file": str(cert)}},
         r"tls_server_config\.client_ca_file: set, but client_auth_type is NoClientCert"),
        ({"tls_server_config": {**tls, "cipher_suites": ["TLS_AES_128_GCM_SHA256"]}},
         r"tls_server_config\.cipher_suites: not supported"),
        ({"basic_auth_users": {"alice": "plaintext-password"}}, r"basic_auth_users\.alice: expected a bcrypt hash"),
        ({"basic_auth_users": ["alice"]}, r"basic_auth_users: expected a mapping"),
        ({"http_server_config": {"headers": {"X-Frame-Options": "allow"}}},
         r"http_server_config\.headers\.X-Frame-Options: expected one of deny, sameorigin"),
        ({"rate_limit": {"interval": "1s", "burst": 5}}, r"rate_limit: not supported"),
        ("tls_server_config: [unclosed", r"not valid YAML"),
    ]


@needs_openssl
def test_each_bad_web_config_is_one_error_naming_the_file_and_the_field(pki, tmp_path):
    other_key = pki.issue("other", 0x99)[1]
    for i, (doc, expected) in enumerate(_bad_configs(pki.dir, *pki.server_a, other_key)):
        path = tmp_path / f"web{i}.yaml"
        path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
        with pytest.raises(ConfigError) as info:
            load_web_config(str(path))
        message = str(info.value)
        assert "\n" not in message and str(path) in message, message
        assert re.search(expected, message), (expected, message)


def test_a_missing_web_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"web config .*absent\.yaml: cannot read web config: No such file"):
        load_web_config(str(tmp_path / "absent.yaml"))


def test_a_web_config_without_tls_fields_serves_plain_http(tmp_path, endpoints):
    served = endpoints(write_web_config(tmp_path / "web.yaml", {"tls_server_config": {}}))
    assert plain_get(served.port, "/metrics") == 200


def test_run_with_a_bad_web_config_exits_2_with_one_line_before_serving_anything(tmp_path):
    path = write_web_config(tmp_path / "web.yaml", {"basic_auth_users": {"alice": "not-a-hash"}})
    done = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--simulate", "single-gpu", "--kubelet-dir", str(tmp_path / "k"),
         "--features-dir", str(tmp_path / "f"), "--metrics-address", "127.0.0.1:0",
         "--web-config-file", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "basic_auth_users.alice" in lines[0], done.stderr
    assert not os.path.exists(tmp_path / "f" / "gpu-topology-agent")  # no labels written


def test_the_web_config_file_is_a_flag_an_environment_variable_and_a_config_field(tmp_path):
    (tmp_path / "c.yaml").write_text("version: v1\nmetrics:\n  webConfigFile: from-file.yaml\n")
    assert load_config(str(tmp_path / "c.yaml"), {}, {}).web_config_file == os.path.abspath("from-file.yaml")
    env = {"WEB_CONFIG_FILE": "/etc/web/env.yaml"}
    assert load_config(str(tmp_path / "c.yaml"), env, {}).web_config_file == "/etc/web/env.yaml"
    flags = {"web_config_file": "/etc/web/flag.yaml"}
    assert load_config(str(tmp_path / "c.yaml"), env, flags).web_config_file == "/etc/web/flag.yaml"
    assert load_config(None, {}, {}).web_config_file == ""


# ------------------------------------------------------------------ real Prometheus
@pytest.fixture
def agent_over_tls(pki, tmp_path):
    """``gpu-topology-agent run`` on a simulated machine, its metrics over TLS with basic
    auth (as a Secret volume holds the certificate); yields (metrics port, probe port)."""
    from agent_run import AgentRun

    secret = SecretVolume(tmp_path / "tls", *pki.server_a)
    web = write_web_config(tmp_path / "web.yaml", tls_and_users(secret.cert, secret.key))
    kubelet_dir = tempfile.mkdtemp(prefix="wc", dir="/tmp")  # unix socket paths: keep it short
    agent = AgentRun(["--simulate", "dgx-h100", "--kubelet-dir", kubelet_dir, "--features-dir", str(tmp_path / "f"),
                      "--pod-resources-socket", f"{kubelet_dir}/podres.sock", "--metrics-address", "127.0.0.1:0",
                      "--web-config-file", str(web)], str(tmp_path / "agent.log"))
    try:
        port, probe_port = agent.ports(60)
        deadline = time.monotonic() + 60
        while plain_get_or_none(probe_port, "/health") != 200:
            assert agent.proc.poll() is None and time.monotonic() < deadline, agent.log()[-3000:]
            time.sleep(0.1)
        yield port, probe_port
    finally:
        if agent.stop(30) is None:
            agent.kill()
        shutil.rmtree(kubelet_dir, ignore_errors=True)


def plain_get_or_none(port: int, path: str) -> int | None:
    try:
        return plain_get(port, path)
    except OSError:
        return None


@needs_prometheus
@needs_openssl
def test_prometheus_scrapes_the_agent_over_tls_with_basic_auth_and_without_credentials_gets_401(
    pki, tmp_path, agent_over_tls
):
    port, probe_port = agent_over_tls
    target = {"static_configs": [{"targets": [f"127.0.0.1:{port}"]}], "scheme": "https",
              "tls_config": {"ca_file": str(pki.ca_cert)}}
    jobs = [
        {"job_name": "with-credentials", "basic_auth": {"username": "prometheus", "password": "s3cret"}, **target},
        {"job_name": "without-credentials", **target},
    ]
    prom = PrometheusServer(tmp_path, "", jobs)
    try:
        temps = prom.wait_for('DCGM_FI_DEV_GPU_TEMP{job="with-credentials"}', 8)
        assert {s["metric"]["Hostname"] for s in temps}  # the agent's own series, over TLS
        up = {s["metric"]["job"]: float(s["value"][1]) for s in prom.wait_for("up", 2)}
        assert up == {"with-credentials": 1.0, "without-credentials": 0.0}
        targets = prom.get("/api/v1/targets")["data"]["activeTargets"]
        refused = [t for t in targets if t["labels"]["job"] == "without-credentials"]
        assert "401" in refused[0]["lastError"], refused
    finally:
        prom.stop()
    assert plain_get(probe_port, "/health") == 200  # the probes need neither TLS nor auth
