"""Throwaway TLS material for loopback deployments and the Flower flags that use it."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TlsFiles", "generate_node_keys", "generate_tls_files", "security_args"]


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a throwaway CA and a SuperLink server certificate it signed."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def generate_tls_files(
    directory: Path, *, days: int = 2, addresses: Sequence[str] = ()
) -> TlsFiles:
    """Writes a throwaway CA and a server certificate for ``127.0.0.1``/``localhost``.

    For runs on this machine only (unencrypted keys, short validity). Same recipe as
    ``deploy/certs/generate.sh``, which writes next to itself; this writes to ``directory``.
    The private keys are 0600; the CA key stays in ``directory`` and no process is given it.

    Args:
        addresses: more IP addresses the server certificate is valid for (the host side of
            shaped links' network namespaces).

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
    sans = ["DNS:localhost", "IP:127.0.0.1", *(f"IP:{a}" for a in addresses)]
    ext.write_text(f"subjectAltName={','.join(sans)}\n")
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
    for key_file in (ca_key, files.server_key):
        key_file.chmod(0o600)
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


def generate_node_keys(directory: Path, count: int) -> list[Path]:
    """Writes ``count`` SuperNode key pairs ``node-<i>`` / ``node-<i>.pub`` (ECDSA P-384).

    The format Flower 1.39's SuperNode authentication reads (OpenSSH, unencrypted): the
    private key (0600) goes to ``flower-supernode --auth-supernode-private-key``, the public
    key to ``flwr supernode register``.

    Returns:
        The private keys' paths, node ``i`` at index ``i``.

    Raises:
        RuntimeError: ``ssh-keygen`` is missing or failed (with its output).
    """
    keygen = shutil.which("ssh-keygen")
    if keygen is None:
        raise RuntimeError("SuperNode authentication needs the ssh-keygen command line tool")
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    keys = []
    for i in range(count):
        key = directory / f"node-{i}"
        for old in (key, key.with_name(f"{key.name}.pub")):
            old.unlink(missing_ok=True)
        result = subprocess.run(
            [keygen, "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-C", f"node-{i}", "-f", key],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"ssh-keygen failed:\n{result.stderr}")
        key.chmod(0o600)
        keys.append(key)
    return keys
