"""The embedded queue over TCP: `tcp://host:port` addresses for producers and consumers elsewhere.

The frames and the authentication are the Unix socket's (tq/wire.py: JSON and Arrow IPC, a mutual
HMAC-SHA256 challenge-response, nothing unpickled); only where the secret comes from differs. A
Unix socket's secret is a 0600 file beside it, which the directory's permissions protect; a TCP
port has no owner, so the secret is shared explicitly by the hosts: a file (`--queue-secret FILE`,
64 hex digits, mode 0600, e.g. on the shared filesystem) or the environment variable
TREEFLOW_QUEUE_SECRET (64 hex digits). Without one, a server on a loopback address (127.0.0.0/8,
::1, localhost) writes a fresh secret to a 0600 file in the private run directory
($XDG_RUNTIME_DIR/treeflow/tcp-HOST-PORT.secret), where the clients of this host find it; a
server on any other address is refused, and so is a client of one.

The trade-off: the connection is authenticated but not encrypted (the episodes travel in the
clear, as in NCCL and gloo); run it on the cluster's private network, or tunnel it (ssh -L,
WireGuard) across untrusted ones. A secret is as safe as the file or environment that holds it.

    treeflow stream --queue tcp://0.0.0.0:5555 --queue-secret /shared/q.secret ...   # host A
    treeflow rollout --queue tcp://hostA:5555 --queue-secret /shared/q.secret ...    # host B
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["ENV_SECRET", "TcpAddress", "is_tcp", "make_secret_file", "parse_tcp", "tcp_secret"]

ENV_SECRET = "TREEFLOW_QUEUE_SECRET"
PREFIX = "tcp://"


@dataclass(frozen=True)
class TcpAddress:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @property
    def family(self) -> int:
        return socket.AF_INET6 if ":" in self.host else socket.AF_INET

    def local_secret_path(self) -> str:
        """Where a loopback server without a given secret writes one (the private run dir)."""
        from treeflow.tq.wire import resolve

        return resolve(f"tcp-{self.host.replace(':', '_')}-{self.port}") + ".secret"


def is_tcp(address) -> bool:
    return isinstance(address, str) and address.startswith(PREFIX)


def parse_tcp(address: str) -> TcpAddress:
    """`tcp://host:port` (IPv6 in brackets); ValueError naming the address and the fix."""
    fix = "give tcp://HOST:PORT, e.g. tcp://127.0.0.1:5555 or tcp://[::1]:5555"
    try:
        parts = urlsplit(address)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"queue address {address!r}: {e}; {fix}") from None
    if parts.path or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"queue address {address!r}: a TCP address is only a host and a port; "
                         f"{fix}")
    if not parts.hostname:
        raise ValueError(f"queue address {address!r} names no host; {fix}")
    if port is None or not 0 < port < 65536:
        raise ValueError(f"queue address {address!r} names no port (1-65535); {fix}")
    return TcpAddress(parts.hostname, port)


def tcp_secret(address: TcpAddress, secret_file: str | None, *, serving: bool) -> tuple[bytes, str]:
    """(secret, where it came from) for a TCP queue: the file given, else $TREEFLOW_QUEUE_SECRET,
    else (loopback only) the private run directory's file -- written fresh when `serving`."""
    from treeflow.tq.wire import read_secret_file

    env = os.environ.get(ENV_SECRET)
    if secret_file is not None and env is not None:
        raise ValueError(f"--queue-secret {secret_file} and ${ENV_SECRET} are both set for "
                         f"{address}; give the secret one way (unset {ENV_SECRET})")
    if secret_file is not None:
        return read_secret_file(os.fspath(secret_file)), os.fspath(secret_file)
    if env is not None:
        try:
            secret = bytes.fromhex(env.strip())
        except ValueError:
            secret = b""
        if len(secret) != 32:
            raise ValueError(f"${ENV_SECRET} is not a queue secret (64 hex digits, "
                             f"{len(env.strip())} characters given); make one with "
                             "`python -c 'import secrets; print(secrets.token_hex(32))'`")
        return secret, f"${ENV_SECRET}"
    if not address.loopback:
        what = "listen on" if serving else "reach"
        raise ValueError(f"{address}: a queue on an address beyond this host needs a shared "
                         f"secret to {what} it: give --queue-secret FILE (64 hex digits, mode "
                         f"0600; the same file on every host) or set ${ENV_SECRET}")
    path = address.local_secret_path()
    if serving:
        from treeflow.tq.wire import check_private, write_secret_to

        check_private(path[:-len(".secret")], create=True)
        return write_secret_to(path), path
    return read_secret_file(path), path


def make_secret_file(path: str) -> str:
    """Write a fresh queue secret to `path` (mode 0600); what `--queue-secret` reads."""
    from treeflow.tq.wire import write_secret_to

    write_secret_to(os.fspath(path))
    return os.fspath(path)


def listen(address: TcpAddress) -> socket.socket:
    s = socket.socket(address.family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address.host, address.port))
    s.listen(128)
    return s


def connect(address: TcpAddress, timeout: float) -> socket.socket:
    s = socket.create_connection((address.host, address.port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small request/answer frames
    return s
