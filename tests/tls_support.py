"""Helpers for the TLS tests (no tests here): certificates made at test time with the
``openssl`` command (Debian's ``openssl`` package), and HTTPS requests with the standard
library.

:class:`Pki` makes a CA, server certificates for ``127.0.0.1``/``localhost`` (each with its
own serial number, so a test can tell which one a connection got) and client certificates.
:class:`SecretVolume` lays certificate files out as the kubelet does for a Secret volume
(``tls.crt -> ..data/tls.crt``, ``..data -> ..<timestamp>``) and rotates them the way the
kubelet's AtomicWriter does (a new timestamped directory, then one rename of ``..data``),
which is how cert-manager's renewals reach a pod.
"""

from __future__ import annotations

import base64
import http.client
import os
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import pytest

OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(
    OPENSSL is None, reason="openssl command not installed (Debian package 'openssl'): no test certificates")


class Pki:
    """A throw-away CA in ``workdir``; EC P-256 keys (fast to make)."""

    def __init__(self, workdir: Path) -> None:
        assert OPENSSL is not None
        self.dir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.ca_cert, self.ca_key = workdir / "ca.crt", workdir / "ca.key"
        self._run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                  "-keyout", self.ca_key, "-out", self.ca_cert, "-days", "2", "-subj", "/CN=test-ca")

    def _run(self, *args: object) -> None:
        done = subprocess.run([OPENSSL, *map(str, args)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr

    def issue(self, name: str, serial: int, *, client: bool = False) -> tuple[Path, Path]:
        """(certificate, key) signed by the CA: a server certificate for 127.0.0.1 and
        localhost, or a client one."""
        key, csr, cert = self.dir / f"{name}.key", self.dir / f"{name}.csr", self.dir / f"{name}.crt"
        ext = self.dir / f"{name}.ext"
        ext.write_text("extendedKeyUsage=clientAuth\n" if client else
                       "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
        self._run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                  "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
        self._run("x509", "-req", "-in", csr, "-CA", self.ca_cert, "-CAkey", self.ca_key,
                  "-set_serial", str(serial), "-days", "2", "-out", cert, "-extfile", ext)
        return cert, key

    def client_context(self, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_cert))
        if cert is not None:
            context.load_cert_chain(str(cert[0]), str(cert[1]))
        return context


class SecretVolume:
    """``tls.crt`` and ``tls.key`` in ``root`` as a Secret volume holds them."""

    def __init__(self, root: Path, cert: Path, key: Path) -> None:
        self.root = root
        root.mkdir()
        self._generation = 0
        self.rotate(cert, key)
        for name in ("tls.crt", "tls.key"):
            os.symlink(f"..data/{name}", root / name)
        self.cert, self.key = root / "tls.crt", root / "tls.key"

    def rotate(self, cert: Path, key: Path) -> None:
        self._generation += 1
        payload = self.root / f"..gen{self._generation}"
        payload.mkdir()
        shutil.copy(cert, payload / "tls.crt")
        shutil.copy(key, payload / "tls.key")
        os.symlink(payload.name, self.root / "..data_tmp")
        os.rename(self.root / "..data_tmp", self.root / "..data")


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def https_get(port: int, context: ssl.SSLContext, path: str = "/metrics",
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one GET over a fresh TLS connection to 127.0.0.1."""
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def peer_serial(port: int, context: ssl.SSLContext) -> str:
    """The serial number (hex, as ``getpeercert`` spells it) of the certificate a new
    connection is shown."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return str(tls.getpeercert()["serialNumber"])
