"""Throwaway TLS material for loopback deployments and the Flower flags that use it."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TlsFiles", "generate_tls_files", "security_args"]


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a throwaway CA and a SuperLink server certificate it signed."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def generate_tls_files(directory: Path, *, days: int = 2) -> TlsFiles:
    """Writes a throwaway CA and a server certificate for ``127.0.0.1``/``localhost``.

    For loopback tests only (unencrypted keys, short validity). Same recipe as
    ``deploy/certs/generate.sh``, which writes next to itself; this writes to ``directory``.

    Raises:
        RuntimeError: ``openssl`` is missing or failed (with its output).
    """
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(
        ca_cert=directory / "ca.crt",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
    )
    ca_key, csr, ext = directory / "ca.key", directory / "server.csr", directory / "san.ext"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    key = ["-newkey", "rsa:2048", "-sha256", "-nodes"]
    commands = [
        ["req", "-x509", *key, "-days", str(days), "-keyout", ca_key, "-out", files.ca_cert]
        + ["-subj", "/CN=fedsparse-test-ca"],
        ["req", *key, "-keyout", files.server_key, "-out", csr, "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", csr, "-CA", files.ca_cert, "-CAkey", ca_key, "-CAcreateserial"]
        + ["-out", files.server_cert, "-days", str(days), "-sha256", "-extfile", ext],
    ]
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("tls=True needs the openssl command line tool")
    for command in commands:
        result = subprocess.run(
            [openssl, *map(str, command)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"openssl {command[0]} failed:\n{result.stderr}")
    for leftover in (csr, ext, directory / "ca.srl"):
        leftover.unlink(missing_ok=True)
    return files


def security_args(tls: TlsFiles | None, *, server: bool) -> list[str]:
    if tls is None:
        return ["--insecure"]
    if not server:
        return ["--root-certificates", str(tls.ca_cert)]
    return [
        "--ssl-ca-certfile",
        str(tls.ca_cert),
        "--ssl-certfile",
        str(tls.server_cert),
        "--ssl-keyfile",
        str(tls.server_key),
    ]
