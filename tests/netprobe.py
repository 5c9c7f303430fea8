"""A foreign process's view of a running job: which TCP ports its processes listen on, and what
they make of bytes from a stranger (tests/test_param_server.py; docs/failures.md "Network surface").

Read from /proc (Linux), no psutil: a process's sockets are the ``socket:[inode]`` links under
/proc/PID/fd, matched against the LISTEN rows (state 0A) of /proc/PID/net/tcp and tcp6.
"""

from __future__ import annotations

import ipaddress
import os
import pickle
import socket
import struct
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tcp_sockets(pid: int | str = "self", *, listening_only: bool = False) -> list[tuple[str, int]]:
    """(local address, port) of ``pid``'s TCP sockets ("self": this process's)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    out = []
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[9] in inodes and (fields[3] == "0A" or not listening_only):  # 0A: LISTEN
                address, port = fields[1].split(":")
                out.append((_address(address), int(port, 16)))
    return out


def listening(pid: int | str) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on."""
    return tcp_sockets(pid, listening_only=True)


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # four host-order 32-bit words
    return socket.inet_ntop(socket.AF_INET6, words)


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


class _Touch:
    """Unpickled, it creates ``path``: the stand-in for any code a pickle can run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def payloads(marker: str) -> list[bytes]:
    """What a stranger sends: a plain HTTP request, a bare pickle that would run code, the same
    pickle behind a length prefix (as a framed protocol would read it), and garbage lengths."""
    code = pickle.dumps(_Touch(marker))
    return [b"GET / HTTP/1.0\r\n\r\n", code, struct.pack("<Q", len(code)) + code,
            b"\xff" * 64 + b"\x00" * 4096]


def send_to(address: str, port: int, data: bytes) -> bool:
    """Connect, send ``data``, read what comes back for a moment, close; False if the connection
    was refused. What the listener answers does not matter, what it does does."""
    try:
        with socket.create_connection((address, port), timeout=2.0) as sock:
            sock.sendall(data)
            sock.settimeout(0.3)
            try:
                sock.recv(256)
            except OSError:  # nothing answered (a timeout) or reset
                pass
    except OSError:
        return False
    return True
