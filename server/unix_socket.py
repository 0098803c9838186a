"""The policy server's Unix domain socket: where a robot on the same host as the server connects
(``unix:///path``) without going through the TCP/IP stack.

The socket file is the only thing guarding it (there is no TLS on it), so :func:`prepare_socket_path`
refuses a path that someone else could reach or replace: the socket's folder must belong to the server's
user and be closed to everyone else (created mode 0700 when missing), the path must name a file in that
folder (no ``..``, no symbolic link in its place), and whatever already lies there must be a stale socket
(no server answers on it), never another file, a live server's socket or a folder. gRPC itself would
silently unlink a live server's socket and take its path; this refuses first. After binding,
:func:`restrict_socket` makes the socket mode 0600.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

MAX_SOCKET_PATH_BYTES = 107
"""The longest socket path Linux takes (``sun_path`` holds 108 bytes, the last a NUL)."""
SOCKET_MODE = 0o600
FOLDER_MODE = 0o700
UNIX_SCHEME = "unix://"


class SocketPathError(ValueError):
    """A socket path the server will not listen on; the message names the path and what was expected."""


def unix_target(path: Path) -> str:
    """The gRPC address of the socket at ``path`` (absolute): ``unix:///abs/path``, what clients connect to."""
    return f"{UNIX_SCHEME}{path}"


def check_socket_path_text(path: Path, field: str = "unix_socket") -> None:
    """What a path alone must be (no file system access): no ``..`` part (the socket must lie in the folder
    its path names), a file name, and at most :data:`MAX_SOCKET_PATH_BYTES` bytes once absolute."""
    if ".." in path.parts:
        raise SocketPathError(
            f"{field}: expected a path without '..' (the socket lies in the folder its path names), got {path}"
        )
    if not path.name:
        raise SocketPathError(f"{field}: expected a file path for the socket, got {path}")
    absolute = Path(os.path.abspath(path))
    size = len(os.fsencode(str(absolute)))
    if size > MAX_SOCKET_PATH_BYTES:
        raise SocketPathError(
            f"{field}: expected a path of at most {MAX_SOCKET_PATH_BYTES} bytes (the Unix socket limit), got "
            f"{size} bytes ({absolute}); use a shorter folder, e.g. under $XDG_RUNTIME_DIR"
        )


def prepare_socket_path(path: Path, field: str = "unix_socket") -> Path:
    """``path`` made absolute and ready to bind: its folder this user's own and closed to others (created
    mode 0700 if missing), a stale socket left there by a server that died removed. Raises
    :class:`SocketPathError` naming ``field`` for anything else."""
    check_socket_path_text(path, field)
    path = Path(os.path.abspath(path))
    _own_folder(path.parent, field)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if stat.S_ISLNK(st.st_mode):
        raise SocketPathError(
            f"{field}: {path} is a symbolic link (it could lead outside {path.parent}); give the socket's own path"
        )
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(
            f"{field}: {path} exists and is not a socket; refusing to replace it (give a new path, or remove it)"
        )
    if _listening(path, field):
        raise SocketPathError(
            f"{field}: a server is already listening on {path}; stop it or give another path"
        )
    path.unlink()  # a socket nobody listens on: left by a server that did not stop cleanly
    return path


def restrict_socket(path: Path) -> None:
    """Make the bound socket at ``path`` readable and writable by this user only (mode 0600): connecting to a
    Unix socket needs write permission on it."""
    os.chmod(path, SOCKET_MODE)


def _own_folder(folder: Path, field: str) -> None:
    """``folder`` exists (created mode 0700 if not), is a folder, belongs to this user and no one else may
    enter or write it (mode 0700 or narrower)."""
    if not folder.exists():
        try:
            folder.mkdir(mode=FOLDER_MODE, parents=True)
        except OSError as e:
            raise SocketPathError(
                f"{field}: could not create the socket's folder {folder}: {e.strerror}"
            ) from None
    st = os.stat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise SocketPathError(f"{field}: {folder} (the socket's folder) is not a folder")
    if st.st_uid != os.getuid():
        raise SocketPathError(
            f"{field}: the socket's folder {folder} belongs to uid {st.st_uid}, not this user ({os.getuid()}); "
            "put the socket in a folder of your own (e.g. under $XDG_RUNTIME_DIR)"
        )
    if st.st_mode & 0o077:
        raise SocketPathError(
            f"{field}: the socket's folder {folder} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"expected 0700 (chmod 700 {folder}, or a folder of its own)"
        )


def _listening(path: Path, field: str) -> bool:
    """Whether a server holds the socket at ``path`` (one that accepts, or whose backlog is full)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except TimeoutError:
            return True
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            if e.errno == errno.EAGAIN:  # its backlog is full: alive
                return True
            raise SocketPathError(f"{field}: could not check {path}: {e.strerror}") from None
    return True
