"""Throw-away TLS material for `RedisServer(tls=True)`: a CA of its own and a server certificate
it signs for 127.0.0.1 (``IP:127.0.0.1`` and ``DNS:localhost``), made by the ``openssl``
command-line tool (no Python dependency), valid for a day.

Keys are P-256 EC keys (made in milliseconds), unencrypted, in the directory given, which the
caller owns and removes.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import ssl
import subprocess
from pathlib import Path
from typing import NamedTuple

from tierkv.errors import DeviceError

#: how long `openssl` may take for one step (each takes milliseconds)
_OPENSSL_TIMEOUT = 30.0
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
_CA_CONFIG = """\
[req]
prompt = no
distinguished_name = dn
x509_extensions = ca
[dn]
CN = tierkv throw-away test CA
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
"""
_SERVER_CONFIG = """\
[req]
prompt = no
distinguished_name = dn
[dn]
CN = 127.0.0.1
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
"""


class TlsFiles(NamedTuple):
    """The PEM files `make_certificates` wrote."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def openssl_path() -> str | None:
    """Where ``openssl`` is on PATH, or ``None``."""
    return shutil.which("openssl")


def openssl_missing() -> str | None:
    """``None`` when ``openssl`` is on PATH, else why not."""
    if openssl_path() is None:
        return ("openssl not on PATH (Debian's openssl package provides it; scripts/setup "
                "installs it)")
    return None


def make_certificates(directory: Path | str) -> TlsFiles:
    """Make a new CA (``ca.pem``, ``ca.key``) and a server certificate it signs for 127.0.0.1
    and localhost (``server.pem``, ``server.key``) in `directory`, which must exist; files of
    those names there are replaced.

    Raises `DeviceError` when ``openssl`` is not on PATH or one of its steps fails (the message
    ends with what it wrote to stderr).
    """
    openssl = openssl_path()
    if openssl is None:
        raise DeviceError("cannot make TLS certificates: openssl is not on PATH (Debian's "
                          "openssl package provides it)")
    where = Path(directory)
    files = TlsFiles(where / "ca.pem", where / "server.pem", where / "server.key")
    ca_key, csr = where / "ca.key", where / "server.csr"
    (where / "ca.cnf").write_text(_CA_CONFIG)
    (where / "server.cnf").write_text(_SERVER_CONFIG)
    _run(openssl, "req", "-x509", *_KEY, "-config", str(where / "ca.cnf"), "-days", "1",
         "-keyout", str(ca_key), "-out", str(files.ca_file))
    _run(openssl, "req", "-new", *_KEY, "-config", str(where / "server.cnf"),
         "-keyout", str(files.key_file), "-out", str(csr))
    _run(openssl, "x509", "-req", "-in", str(csr), "-CA", str(files.ca_file),
         "-CAkey", str(ca_key), "-set_serial", f"0x{secrets.token_hex(16)}", "-days", "1",
         "-extfile", str(where / "server.cnf"), "-extensions", "server",
         "-out", str(files.cert_file))
    csr.unlink()
    return files


def client_context(ca_file: Path | str) -> ssl.SSLContext:
    """A client context that trusts only `ca_file` and checks the server's name."""
    return ssl.create_default_context(cafile=str(ca_file))


def wrap(sock: socket.socket, context: ssl.SSLContext | None, host: str) -> socket.socket:
    """`sock` itself without a `context`, else `sock` over TLS to `host` (handshake done)."""
    return sock if context is None else context.wrap_socket(sock, server_hostname=host)


def _run(openssl: str, *args: str) -> None:
    try:
        done = subprocess.run([openssl, *args], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=_OPENSSL_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise DeviceError(f"openssl {args[0]} took over {_OPENSSL_TIMEOUT:g} s") from None
    if done.returncode != 0:
        raise DeviceError(f"openssl {args[0]} failed with status {done.returncode}:\n"
                          f"{done.stderr.strip()}")
