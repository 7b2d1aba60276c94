"""Where a queue lives and whose it is: socket addresses, ownership checks, secret files.

An address is a socket path, or a bare queue name in a private run directory
($XDG_RUNTIME_DIR/treeflow/, mode 0700). Next to the socket lies its secret file
(`<socket>.secret`, 32 random bytes in hex, mode 0600), written fresh by each server;
the handshake over it is tq/wire.py's. Before trusting any of that, a client checks that
the directory, the socket and the secret file belong to it and are not writable by group
or others, and says whose they are when not.

The trade-off: the checks trust the file system's owner and mode bits (the same trust as
the owner's other files) rather than anything the peer says, so they cost a few stat calls
per connection and refuse a shared directory outright, even where its other users are
trusted.
"""

from __future__ import annotations

import os
import pwd
import secrets
import stat

__all__ = ["check_private", "check_private_file", "read_secret", "read_secret_file", "resolve",
           "secret_path", "write_secret", "write_secret_to"]

_SOCKET_PATH_MAX = 107         # sun_path less its terminating NUL (Linux)


def resolve(address: str | os.PathLike) -> str:
    """The socket path of `address`: a path as given, or a bare name in the private run dir.

    A name without '/' lives in $XDG_RUNTIME_DIR/treeflow/ (or ~/.treeflow/run/ without it),
    a directory of mode 0700; `.sock` is added when missing.
    """
    address = os.fspath(address)
    if not address:
        raise ValueError("the queue address is empty; give a socket path or a queue name")
    if "/" not in address:
        base = os.environ.get("XDG_RUNTIME_DIR")
        root = os.path.join(base, "treeflow") if base else \
            os.path.join(os.path.expanduser("~"), ".treeflow", "run")
        address = os.path.join(root, address if address.endswith(".sock") else address + ".sock")
    path = os.path.abspath(address)
    if len(os.fsencode(path)) > _SOCKET_PATH_MAX:
        raise ValueError(f"{path}: a Unix socket path may hold at most {_SOCKET_PATH_MAX} bytes; "
                         "give a shorter path or a queue name")
    return path


def secret_path(address: str) -> str:
    return address + ".secret"


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _check_mine(path: str, st: os.stat_result, what: str) -> None:
    me = os.geteuid()
    if st.st_uid != me:
        raise ValueError(f"{path}: the queue's {what} belongs to {_owner(st.st_uid)}, not to "
                         f"{_owner(me)}: refused (another user may have put it there); use a "
                         "directory of your own, e.g. a queue name, which lives in "
                         "$XDG_RUNTIME_DIR/treeflow")
    if st.st_mode & 0o022:
        raise ValueError(f"{path}: the queue's {what} is writable by group or others (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}), so another user could replace what "
                         "is in it: refused; use a private directory (chmod 700, or a queue name)")


def check_private(address: str, *, create: bool = False) -> None:
    """ValueError unless `address`'s directory (and socket, if there) are ours and private."""
    d = os.path.dirname(address)
    if create and not os.path.exists(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
    try:  # the socket first: whose it is says most about a squatter
        st = os.lstat(address)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise ValueError(f"{address}: is not a socket (a {_kind(st)}); refused")
        _check_mine(address, st, "socket")
    try:
        st = os.stat(d)
    except FileNotFoundError:
        raise ValueError(f"{address}: the directory {d} does not exist; create it (mkdir -m 700 "
                         f"{d}) or give a queue name") from None
    _check_mine(d, st, "directory")


def check_private_file(path: str) -> None:
    """ValueError unless `path`'s directory is ours and private (made if absent) and `path`,
    if there, is a regular file of ours that group and others cannot write (a server's log,
    kept across restarts on the same port)."""
    d = os.path.dirname(path)
    os.makedirs(d, mode=0o700, exist_ok=True)
    _check_mine(d, os.stat(d), "directory")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: is not a regular file (a {_kind(st)}); refused")
    _check_mine(path, st, "log file")


def _kind(st) -> str:
    return "directory" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) \
        else "file"


def write_secret(address: str) -> bytes:
    """A fresh secret for the queue at `address`, written to its secret file (mode 0600)."""
    return write_secret_to(secret_path(address))


def write_secret_to(path: str) -> bytes:
    """A fresh 32-byte secret written to `path` as 64 hex digits (mode 0600)."""
    from treeflow.atomic import atomic_path

    secret = secrets.token_bytes(32)
    with atomic_path(path, what="queue secret") as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret.hex() + "\n")
    return secret


def read_secret(address: str) -> bytes:
    """The secret of the queue at `address`; ValueError unless its file is ours and mode 0600."""
    return read_secret_file(secret_path(address), missing=f"the server at {address} was not "
                            "started by this treeflow (restart it)")


def read_secret_file(path: str, *, missing: str = "give the file the queue's server reads "
                     "(--queue-secret), or start the server first") -> bytes:
    """A queue secret from `path`; ValueError unless the file is ours, mode 0600, 64 hex digits."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ValueError(f"{path}: the queue's secret file is missing; {missing}") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the queue's secret ({e.strerror}); it must be a "
                         "plain file of yours") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: the queue's secret is not a plain file; refused")
        _check_mine(path, st, "secret file")
        if stat.S_IMODE(st.st_mode) != 0o600:
            raise ValueError(f"{path}: the queue's secret file has mode "
                             f"{stat.S_IMODE(st.st_mode):04o}, not 0600 (others may have read "
                             "it): refused; chmod 600 it after making a new secret, or restart "
                             "the queue to write a new one")
        text = f.read(200).strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != 32:
        raise ValueError(f"{path}: not a queue secret (64 hex digits); write one with "
                         "`python -c 'import secrets; print(secrets.token_hex(32))'` (mode 0600), "
                         "or restart the queue")
    return secret
