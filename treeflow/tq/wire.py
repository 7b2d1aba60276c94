"""The embedded queue's wire protocol: JSON and Arrow IPC in length-prefixed frames, no pickle.

A message is one frame:

    u32 header bytes | u32 blobs | u64 length of each blob | JSON header | the blobs

The header is JSON; an Arrow table inside it is a reference `{"~a": i}` to blob i, an
Arrow IPC stream. Tuples, dicts with non-string keys and the ledger's own dataclasses
(`Group`, `Delivery`, ...) and exceptions (`QueueFull`, ...) have tags of their own; a
decoder builds nothing else, so a peer -- honest or not -- can send data, never code.
The server never opens a payload: it keeps each blob as bytes (`Blob`) and sends it back
as it came, so it needs no pyarrow and moves each payload without re-encoding it.

Who may talk (Unix sockets; TCP addresses share the secret explicitly, tq/tcp.py): the
socket lives in a directory only its owner can write, beside a secret file written fresh
by each server (tq/access.py: addresses, secret files and the ownership checks a client
makes first; its names are re-exported here). A connection starts with a mutual
HMAC-SHA256 challenge-response over that secret: the server proves it knows it (a
squatter at the path cannot impersonate the queue), the client proves it too (another
user cannot attach).

The same frames (`pack`, `unpack`) carry values between the ranks of one run
(train/collectives.py) instead of torch's object collectives, which unpickle.

The trade-off: one secret per queue, readable by every process of its owner (the same
trust as the owner's files), and a frame header in JSON (a few hundred bytes per call,
well under a millisecond) in exchange for a format any language can speak.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
import struct
import time

from treeflow import _json
from treeflow.tq import protocol as _protocol
from treeflow.tq.access import (check_private, check_private_file, read_secret, read_secret_file,
                                resolve, secret_path, write_secret, write_secret_to)

__all__ = ["Blob", "MAX_FRAME", "PeerClosed", "PeerError", "Unreadable", "check_private",
           "check_private_file", "client_handshake", "decode", "encode", "pack",
           "read_secret", "read_secret_file", "recv", "resolve", "secret_path", "send",
           "server_handshake", "unpack", "write_secret", "write_secret_to"]

MAGIC = b"TFTQ\x01\n"          # protocol name and version, sent first by the server
NONCE = 32
_PREFIX = struct.Struct("!II")
_MAX_HEADER = 64 << 20
_MAX_BLOBS = 1 << 20
_MAX_DEPTH = 64                # a frame nests under 10 levels; deeper is refused before parsing
MAX_FRAME = 4 << 30            # a frame's announced bytes (header and blobs) a server accepts
_CHUNK = 1 << 20               # a blob's buffer starts this big and doubles as its bytes arrive

_DATACLASSES = {n: getattr(_protocol, n) for n in _protocol.__all__
                if dataclasses.is_dataclass(getattr(_protocol, n))}
_ERRORS = {c.__name__: c for c in (ValueError, TypeError, KeyError, IndexError, RuntimeError,
                                   TimeoutError, AssertionError, NotImplementedError)}
_ERRORS.update({n: getattr(_protocol, n) for n in _protocol.__all__
                if isinstance(getattr(_protocol, n), type)
                and issubclass(getattr(_protocol, n), Exception)})


class PeerError(ConnectionError):
    """The other end broke the protocol or went away (the call's outcome is unknown)."""


class PeerClosed(PeerError):
    """The other end closed the connection before the first byte of a read (between calls)."""


class Blob:
    """A payload as bytes, kept unopened by the server."""

    __slots__ = ("data",)

    def __init__(self, data):
        self.data = data


class Unreadable:
    """A payload that is not an Arrow IPC stream (`decode(..., lenient=True)`): the frame
    itself was sound, so the caller decides (a consumer rejects the step that holds it)."""

    __slots__ = ("index", "reason")

    def __init__(self, index: int, reason: str):
        self.index, self.reason = index, reason

    def __repr__(self) -> str:
        return f"Unreadable(blob {self.index}: {self.reason})"


# ------------------------------------------------------------------ values
def encode(value) -> tuple[bytes, list]:
    """(JSON header bytes, blobs) for `value`: JSON values, tuples, Arrow tables, ledger types."""
    blobs: list = []
    header = json.dumps(_enc(value, blobs), separators=(",", ":")).encode()
    return header, blobs


def _enc(v, blobs):
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, list):
        return [_enc(x, blobs) for x in v]
    if isinstance(v, tuple):
        return {"~t": [_enc(x, blobs) for x in v]}
    if isinstance(v, dict):
        if all(isinstance(k, str) and not k.startswith("~") for k in v):
            return {k: _enc(x, blobs) for k, x in v.items()}
        return {"~d": [[_enc(k, blobs), _enc(x, blobs)] for k, x in v.items()]}
    if isinstance(v, Blob):
        blobs.append(v.data)
        return {"~a": len(blobs) - 1}
    if isinstance(v, BaseException):
        name = type(v).__name__ if type(v).__name__ in _ERRORS else "RuntimeError"
        text = str(v) if name == type(v).__name__ else f"{type(v).__name__}: {v}"
        return {"~e": name, "m": text}
    if dataclasses.is_dataclass(v) and type(v).__name__ in _DATACLASSES:
        # a field at its default is not sent: a field added later reaches an older peer
        # (which would refuse its name) only when it is set
        return {"~c": type(v).__name__,
                "f": {f.name: _enc(getattr(v, f.name), blobs) for f in dataclasses.fields(v)
                      if f.default is dataclasses.MISSING or getattr(v, f.name) != f.default}}
    if hasattr(v, "item") and getattr(v, "ndim", None) == 0:  # a numpy scalar
        return _enc(v.item(), blobs)
    import pyarrow as pa

    if isinstance(v, pa.Table):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, v.schema) as w:
            w.write_table(v)
        blobs.append(sink.getvalue())
        return {"~a": len(blobs) - 1}
    raise TypeError(f"a {type(v).__name__} cannot travel through the queue socket (JSON values, "
                    "tuples and Arrow tables only)")


def decode(header: bytes, blobs: list, *, arrow: bool, lenient: bool = False):
    """The value `encode` made; blobs become Arrow tables (`arrow`) or stay `Blob`s.

    lenient: a blob that is not an Arrow IPC stream becomes an `Unreadable` (a payload a
    producer got wrong, for the consumer to reject) instead of failing the whole frame."""
    try:
        tree = _json.loads(header, what="a frame header", max_depth=_MAX_DEPTH)
    except ValueError as e:
        raise PeerError(str(e)) from None
    return _dec(tree, blobs, arrow, lenient)


def _dec(v, blobs, arrow, lenient):
    if isinstance(v, list):
        return [_dec(x, blobs, arrow, lenient) for x in v]
    if not isinstance(v, dict):
        return v
    if "~t" in v:
        return tuple(_dec(x, blobs, arrow, lenient) for x in v["~t"])
    if "~d" in v:
        return {_hashable(_dec(k, blobs, arrow, lenient)): _dec(x, blobs, arrow, lenient)
                for k, x in v["~d"]}
    if "~a" in v:
        i = v["~a"]
        if not isinstance(i, int) or not 0 <= i < len(blobs):
            raise PeerError(f"a frame refers to blob {i!r} of {len(blobs)}")
        if not arrow:
            return Blob(blobs[i])
        import pyarrow as pa

        try:
            return pa.ipc.open_stream(pa.py_buffer(blobs[i])).read_all()
        except pa.ArrowException as e:
            if lenient:
                return Unreadable(i, str(e))
            raise PeerError(f"blob {i} is not an Arrow IPC stream ({e})") from None
    if "~c" in v:
        cls = _DATACLASSES.get(v["~c"])
        if cls is None or not isinstance(v.get("f"), dict):
            raise PeerError(f"a frame names the type {v['~c']!r}, which the queue does not send")
        try:
            return cls(**{k: _dec(x, blobs, arrow, lenient) for k, x in v["f"].items()})
        except TypeError as e:
            raise PeerError(f"a frame's {v['~c']} does not fit ({e})") from None
    if "~e" in v:
        return _ERRORS.get(v["~e"], RuntimeError)(str(v.get("m", "")))
    return {k: _dec(x, blobs, arrow, lenient) for k, x in v.items()}


def _hashable(k):
    return tuple(k) if isinstance(k, list) else k


# ------------------------------------------------------------------ frames
def send(sock, header: bytes, blobs: list) -> None:
    """Write one frame: prefix, blob lengths, header, blobs (one gathered write where it fits)."""
    views = [memoryview(b).cast("B") for b in blobs]
    head = _PREFIX.pack(len(header), len(views)) + struct.pack(f"!{len(views)}Q",
                                                               *(v.nbytes for v in views))
    parts = [memoryview(head), memoryview(header), *(v for v in views if v.nbytes)]
    i = 0
    while i < len(parts):
        n = sock.sendmsg(parts[i:i + 256])
        while n and i < len(parts):
            if n >= parts[i].nbytes:
                n -= parts[i].nbytes
                i += 1
            else:
                parts[i] = parts[i][n:]
                n = 0


def _read_exact(sock, n: int, deadline: float | None = None) -> bytearray:
    """n bytes from `sock`, in a buffer that grows (doubling) as they arrive: a peer that
    announces a large blob and sends little holds little (the announcement allocates nothing).
    deadline: a time.monotonic() by which all n must have come (socket.timeout past it)."""
    buf = bytearray(min(n, _CHUNK))
    got = 0
    while got < n:
        if got == len(buf):
            buf.extend(bytes(min(n, 2 * len(buf)) - len(buf)))
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
        k = sock.recv_into(memoryview(buf)[got:])
        if k == 0:
            if got:
                raise PeerError("the queue connection closed in the middle of a message")
            raise PeerClosed("the queue connection closed")
        got += k
    return buf


def recv(sock, max_frame: int | None = None) -> tuple[bytes, list]:
    """(header, blobs) of the next frame, each blob its own buffer; PeerError on a bad one.

    max_frame: the most bytes (header and blobs) a frame may announce; refused before
    anything is allocated for it (None: no limit but the format's)."""
    hlen, nblobs = _PREFIX.unpack(_read_exact(sock, _PREFIX.size))
    if hlen > _MAX_HEADER or nblobs > _MAX_BLOBS:
        raise PeerError(f"a frame announces a {hlen}-byte header and {nblobs} blobs, more than "
                        f"the {_MAX_HEADER} bytes and {_MAX_BLOBS} blobs a frame may hold; refused")
    sizes = struct.unpack(f"!{nblobs}Q", _read_exact(sock, 8 * nblobs)) if nblobs else ()
    total = hlen + sum(sizes)
    if max_frame is not None and total > max_frame:
        raise PeerError(f"a frame announces {total} bytes ({nblobs} blobs, the largest "
                        f"{max(sizes, default=0)} bytes), more than the {max_frame} bytes this "
                        "queue takes in one call; refused before reading it")
    header = bytes(_read_exact(sock, hlen))
    return header, [_read_exact(sock, s) for s in sizes]


# ------------------------------------------------------------------ authentication
def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def server_handshake(sock, secret: bytes, deadline: float | None = None) -> bool:
    """Challenge the client, answer its challenge; False (connection unusable) if it failed.

    deadline: a time.monotonic() by which the client's whole answer must have come (a peer
    that trickles a byte at a time does not hold its connection past it)."""
    nonce = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + nonce)
    reply = _read_exact(sock, 32 + NONCE, deadline)
    if not hmac.compare_digest(bytes(reply[:32]), _mac(secret, b"client", nonce)):
        sock.sendall(b"\x00")
        return False
    sock.sendall(b"\x01" + _mac(secret, b"server", bytes(reply[32:]), nonce))
    return True


def client_handshake(sock, secret: bytes, address: str, source: str | None = None) -> None:
    """Prove the secret to the server and check that it knows it too; ValueError if not.

    source: where the secret came from, for the messages (default: the socket's secret file)."""
    source = source or secret_path(address)
    got = _read_exact(sock, len(MAGIC) + NONCE)
    if bytes(got[:len(MAGIC)]) != MAGIC:
        raise ValueError(f"{address}: what answers there is not a treeflow queue of this version "
                         "(no greeting); start the queue with this treeflow")
    nonce_s, nonce_c = bytes(got[len(MAGIC):]), secrets.token_bytes(NONCE)
    sock.sendall(_mac(secret, b"client", nonce_s) + nonce_c)
    status = _read_exact(sock, 1)
    if status != b"\x01":
        raise ValueError(f"{address}: the queue refused this client's secret "
                         f"({source} is not the running server's; was the queue "
                         "restarted by someone else, or given another secret?)")
    proof = _read_exact(sock, 32)
    if not hmac.compare_digest(bytes(proof), _mac(secret, b"server", nonce_c, nonce_s)):
        raise ValueError(f"{address}: the process listening there does not know the queue's "
                         f"secret ({source}): not our queue server; refused")


# ------------------------------------------------------------------ between ranks
def pack(value) -> bytes:
    """`value` as one frame in memory (what `send` would write)."""
    header, blobs = encode(value)
    views = [memoryview(b).cast("B") for b in blobs]
    return b"".join([_PREFIX.pack(len(header), len(views)),
                     struct.pack(f"!{len(views)}Q", *(v.nbytes for v in views)), header, *views])


def unpack(data, *, arrow: bool = True):
    """The value of a frame made by `pack`."""
    view = memoryview(data).cast("B")
    hlen, nblobs = _PREFIX.unpack(view[:_PREFIX.size])
    at = _PREFIX.size + 8 * nblobs
    sizes = struct.unpack(f"!{nblobs}Q", view[_PREFIX.size:at])
    header, at = bytes(view[at:at + hlen]), at + hlen
    blobs = []
    for s in sizes:
        blobs.append(view[at:at + s])
        at += s
    if at != len(view):
        raise PeerError(f"a frame of {len(view)} bytes holds {at}")
    return decode(header, blobs, arrow=arrow)
