"""The metrics address's web configuration: exporter-toolkit's format (TLS, basic auth).

``--web-config-file`` names a YAML file in the format dcgm-exporter and every Prometheus
exporter read (prometheus/exporter-toolkit, ``docs/web-configuration.md``)::

    tls_server_config:
      cert_file: tls.crt          # relative paths are relative to the web config file
      key_file: tls.key
      client_auth_type: RequireAndVerifyClientCert   # default NoClientCert
      client_ca_file: ca.crt
      min_version: TLS12          # TLS10, TLS11, TLS12 (default), TLS13
      max_version: TLS13          # default TLS13
    http_server_config:
      headers: {X-Content-Type-Options: nosniff}
    basic_auth_users:
      prometheus: $2y$10$...      # bcrypt hashes (htpasswd -nBC 10 "" | tr -d ':\\n')

As in exporter-toolkit: unknown keys are errors; TLS is on when any TLS field is set, and then
``cert_file`` and ``key_file`` are required; a client CA without a client auth type is an
error; a verifying client auth type without ``client_ca_file`` verifies against the system's
CAs; an empty ``basic_auth_users`` means no authentication; an unknown user costs one bcrypt
comparison like a known one (a fixed hash), so names cannot be told apart by timing; checked
passwords are cached (by digest) so a scraper pays bcrypt once, not per scrape.

Where the format asks for what Python's ``ssl`` cannot give, or for a feature this agent does
not have, the key is refused at start naming it, never silently ignored (a security setting
that is ignored is worse than one refused): ``RequireAnyClientCert`` (OpenSSL checks every
client certificate it asks for; use ``RequireAndVerifyClientCert``), inline ``cert``/``key``/
``client_ca``, ``cipher_suites``, ``curve_preferences``, ``client_allowed_sans``,
``rate_limit``. Accepted without effect: ``prefer_server_cipher_suites`` and
``http_server_config.http2`` (the agent speaks HTTP/1.1). ``RequestClientCert`` admits every
client as exporter-toolkit does, without asking for a certificate.

:class:`WebConfigWatch` keeps the configuration in force and re-reads it when the file, or a
certificate, key or CA file it names, changed (checked at each new connection, as
exporter-toolkit re-reads at each handshake): cert-manager's rotation reaches the next
connection, connections already open finish with what they started with, and a changed file
that does not load is logged once and the last good configuration kept.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import re
import ssl
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping

import bcrypt

from agent.errors import ConfigError, InputFormatError, shorten
from agent.formats import read_document

log = logging.getLogger(__name__)

CLIENT_AUTH_TYPES: Mapping[str, ssl.VerifyMode] = {
    "NoClientCert": ssl.CERT_NONE,
    # Go's "ask, accept anything": OpenSSL cannot ask without checking, so it does not ask
    "RequestClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_VERSIONS: Mapping[str, ssl.TLSVersion] = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
#: exporter-toolkit's settable response headers and their allowed values (None: any)
HEADERS: Mapping[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
_TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version",
             "max_version", "prefer_server_cipher_suites")
_REFUSED_TLS_KEYS: Mapping[str, str] = {
    "cert": "inline certificates are not supported: use cert_file",
    "key": "inline keys are not supported: use key_file",
    "client_ca": "inline CAs are not supported: use client_ca_file",
    "cipher_suites": "not supported (OpenSSL's defaults for the TLS versions allowed are used)",
    "curve_preferences": "not supported (OpenSSL's defaults are used)",
    "client_allowed_sans": "not supported: give the allowed clients their own CA (client_ca_file)",
}
_BCRYPT_HASH = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
#: compared against when the user is unknown (a bcrypt hash of cost 10, like the usual ones)
_UNKNOWN_USER_HASH = b"$2b$10$hIebvb7wGh8bfbJFjoYSJuefEiMKhtFx25ReBWx1ix27dRs0HBRke"


@dataclass(frozen=True)
class TlsSettings:
    """``tls_server_config``; paths are absolute."""

    cert_file: str
    key_file: str
    client_auth_type: str = "NoClientCert"
    client_ca_file: str = ""
    min_version: str = "TLS12"
    max_version: str = "TLS13"


@dataclass(frozen=True, eq=False)
class WebConfig:
    """One loaded web configuration. ``context`` is None when TLS is off."""

    path: str
    tls: TlsSettings | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)  # name -> bcrypt hash
    headers: tuple[tuple[str, str], ...] = ()
    context: ssl.SSLContext | None = None

    def watched_files(self) -> tuple[str, ...]:
        """The file itself and the files it names: a change to any is a reload."""
        if self.tls is None:
            return (self.path,)
        files = (self.path, self.tls.cert_file, self.tls.key_file, self.tls.client_ca_file)
        return tuple(f for f in files if f)


def load_web_config(path: str) -> WebConfig:
    """Read, check and build (the SSL context, certificates loaded) the web configuration
    in ``path``. Raises :class:`ConfigError`, one line naming the file and the field."""
    try:
        doc = read_document(path, "web config")
    except InputFormatError as exc:  # names the file: "PATH: cannot read web config: ..."
        raise ConfigError(f"web config {exc}") from None
    try:
        return _parse(doc, path)
    except ValueError as exc:
        raise ConfigError(f"web config {path}: {exc}") from None


def _parse(doc: object, path: str) -> WebConfig:
    top = _mapping(doc, "(top level)")
    _check_keys(top, ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"), "")
    if "rate_limit" in top:
        raise ValueError("rate_limit: not supported by gpu-topology-agent")
    base = os.path.dirname(os.path.abspath(path))
    tls = _parse_tls(_mapping(top.get("tls_server_config"), "tls_server_config"), base)
    users = _parse_users(_mapping(top.get("basic_auth_users"), "basic_auth_users"))
    headers = _parse_http(_mapping(top.get("http_server_config"), "http_server_config"))
    context = build_context(tls) if tls is not None else None
    return WebConfig(os.path.abspath(path), tls, users, headers, context)


def _parse_tls(section: Mapping[str, Any], base: str) -> TlsSettings | None:
    where = "tls_server_config"
    for key, why in _REFUSED_TLS_KEYS.items():
        if key in section:
            raise ValueError(f"{where}.{key}: {why}")
    _check_keys(section, _TLS_KEYS, where)
    values = {k: _string(section[k], f"{where}.{k}") for k in _TLS_KEYS[:-1] if section.get(k) is not None}
    if "prefer_server_cipher_suites" in section and not isinstance(section["prefer_server_cipher_suites"], bool):
        raise ValueError(f"{where}.prefer_server_cipher_suites: expected true or false")
    if not any(values.values()):
        return None  # exporter-toolkit: no TLS field set is plain HTTP
    for key in ("cert_file", "key_file"):
        if not values.get(key):
            raise ValueError(f"{where}.{key}: missing (TLS needs cert_file and key_file)")
    auth = values.get("client_auth_type") or "NoClientCert"
    if auth in ("RequireAnyClientCert", "RequireClientCert"):
        raise ValueError(
            f"{where}.client_auth_type: {auth} (any certificate, unchecked) is not supported:"
            " OpenSSL checks every client certificate it asks for; use RequireAndVerifyClientCert"
            " with client_ca_file"
        )
    if auth not in CLIENT_AUTH_TYPES:
        expected = ", ".join(CLIENT_AUTH_TYPES)
        raise ValueError(f"{where}.client_auth_type: expected one of {expected}, got {shorten(auth)!r}")
    for key in ("min_version", "max_version"):
        if key in values and values[key] not in TLS_VERSIONS:
            raise ValueError(f"{where}.{key}: expected one of {', '.join(TLS_VERSIONS)}, got {shorten(values[key])!r}")
    for key in ("cert_file", "key_file", "client_ca_file"):
        if values.get(key):
            values[key] = os.path.join(base, values[key])  # an absolute path stays as it is
    values["client_auth_type"] = auth
    return TlsSettings(**values)


def build_context(tls: TlsSettings) -> ssl.SSLContext:
    """The server's SSL context for ``tls``, certificates loaded. ValueError names the field."""
    where = "tls_server_config"
    low, high = TLS_VERSIONS[tls.min_version], TLS_VERSIONS[tls.max_version]
    if low > high:
        raise ValueError(f"{where}.min_version: {tls.min_version} is above max_version {tls.max_version}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version, context.maximum_version = low, high
    context.set_alpn_protocols(["http/1.1"])
    cert, key = _read(tls.cert_file, f"{where}.cert_file"), _read(tls.key_file, f"{where}.key_file")
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise ValueError(f"{where}.cert_file: {tls.cert_file} holds no PEM certificate")
    if b"PRIVATE KEY-----" not in key:
        raise ValueError(f"{where}.key_file: {tls.key_file} holds no PEM private key")
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise ValueError(f"{where}.key_file: {tls.key_file} is not the key of cert_file {tls.cert_file}") from None
        why = exc.reason or exc
        raise ValueError(f"{where}.cert_file: {tls.cert_file} with key_file {tls.key_file}: {why}") from None
    context.verify_mode = CLIENT_AUTH_TYPES[tls.client_auth_type]
    if tls.client_ca_file:
        if context.verify_mode == ssl.CERT_NONE:
            raise ValueError(
                f"{where}.client_ca_file: set, but client_auth_type is {tls.client_auth_type}"
                " (use VerifyClientCertIfGiven or RequireAndVerifyClientCert)"
            )
        _read(tls.client_ca_file, f"{where}.client_ca_file")
        try:
            context.load_verify_locations(cafile=tls.client_ca_file)
        except ssl.SSLError as exc:
            raise ValueError(f"{where}.client_ca_file: {tls.client_ca_file}: {exc.reason or exc}") from None
    elif context.verify_mode != ssl.CERT_NONE:
        context.load_default_certs(ssl.Purpose.CLIENT_AUTH)  # Go verifies against the system's CAs
    return context


def _parse_users(section: Mapping[str, Any]) -> dict[str, bytes]:
    users: dict[str, bytes] = {}
    for name, hashed in section.items():
        where = f"basic_auth_users.{shorten(name)}"
        text = _string(hashed, where)
        match = _BCRYPT_HASH.fullmatch(text)
        if match is None or not 4 <= int(match.group(1)) <= 31:
            raise ValueError(f"{where}: expected a bcrypt hash ($2y$10$ and 53 characters), got {shorten(text, 12)!r}")
        users[str(name)] = text.encode("ascii")
    return users


def _parse_http(section: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    where = "http_server_config"
    _check_keys(section, ("http2", "headers"), where)
    if "http2" in section and not isinstance(section["http2"], bool):
        raise ValueError(f"{where}.http2: expected true or false")
    headers = []
    for name, value in _mapping(section.get("headers"), f"{where}.headers").items():
        at = f"{where}.headers.{shorten(name)}"
        if name not in HEADERS:
            raise ValueError(f"{at}: cannot be set (expected one of {', '.join(HEADERS)})")
        text, allowed = _string(value, at), HEADERS[name]
        if allowed is not None and text not in allowed:
            raise ValueError(f"{at}: expected one of {', '.join(allowed)}, got {shorten(text)!r}")
        if text:
            headers.append((str(name), text))
    return tuple(headers)


def _read(path: str, where: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(1 << 20)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read {path}: {exc.strerror or exc}") from None


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {shorten(repr(value))}")
    return value


def _check_keys(section: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in section:
        if key not in allowed:
            prefix = f"{where}." if where else ""
            raise ValueError(f"{prefix}{shorten(key)}: unknown key (expected one of {', '.join(allowed)})")


# ----------------------------------------------------------------------------- in force
def _stamp(paths: tuple[str, ...]) -> tuple[object, ...]:
    """What tells a changed file: inode, size and mtime (a Secret volume swaps a symlink)."""
    out: list[object] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError as exc:
            out.append((path, exc.errno))
            continue
        out.append((path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class WebConfigWatch:
    """The web configuration in force: :meth:`current` re-reads it when a watched file
    changed, keeping the last good one (and saying why once) when the new one is bad.
    Whether TLS is on is decided at start: a change that turns it on or off is refused."""

    def __init__(self, config: WebConfig) -> None:
        self._config = config
        self._stamp = _stamp(config.watched_files())
        self._refused: tuple[object, ...] | None = None
        self._lock = threading.Lock()
        self.auth = BasicAuth()

    def current(self) -> WebConfig:
        config = self._config
        stamp = _stamp(config.watched_files())
        if stamp == self._stamp or stamp == self._refused:
            return config
        with self._lock:
            if config is not self._config:  # another connection reloaded meanwhile
                return self._config
            try:
                new = load_web_config(config.path)
                if (new.tls is None) != (config.tls is None):
                    raise ConfigError(f"web config {config.path}: TLS is switched on or off only at start")
            except ConfigError as exc:
                if stamp != self._refused:
                    log.error("%s; keeping the configuration in force", exc)
                self._refused = stamp
                return config
            self._config, self._stamp, self._refused = new, _stamp(new.watched_files()), None
            log.info("web config %s re-read: new connections use it", config.path)
            return new


class BasicAuth:
    """Checks ``Authorization: Basic`` against bcrypt hashes, one comparison at a time (it
    costs ~70 ms of CPU at cost 10). Good answers are cached apart from bad ones, so a flood
    of wrong passwords cannot push a scraper's cached answer out."""

    MAX_CACHED = 256

    def __init__(self) -> None:
        self._good: OrderedDict[bytes, None] = OrderedDict()
        self._bad: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def allows(self, users: Mapping[str, bytes], header: str | None) -> bool:
        """True when ``users`` is empty or ``header`` names a user with the right password."""
        if not users:
            return True
        credentials = _basic_credentials(header)
        if credentials is None:
            return False
        name, password = credentials
        hashed = users.get(name)
        key = hashlib.sha256(b"\0".join((name.encode(), hashed or b"", password))).digest()
        with self._lock:
            if key in self._good:
                return True
            if key in self._bad:
                return False
            # bcrypt reads 72 bytes of a password (the bcrypt package refuses more)
            ok = bcrypt.checkpw(password[:72], hashed or _UNKNOWN_USER_HASH) and hashed is not None
            cache = self._good if ok else self._bad
            cache[key] = None
            if len(cache) > self.MAX_CACHED:
                cache.popitem(last=False)
            return ok


def _basic_credentials(header: str | None) -> tuple[str, bytes] | None:
    if not header or not header[:6].lower() == "basic ":
        return None
    try:
        decoded = base64.b64decode(header[6:].strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    name, sep, password = decoded.partition(b":")
    if not sep:
        return None
    return name.decode("utf-8", "replace"), password
