"""Local workers listen on loopback only (issue 23, item 6, "Paths and addresses").

gloo binds its sockets to the address the host name resolves to unless GLOO_SOCKET_IFNAME names an
interface; on a machine whose host name resolves to its network address, a local ``--nproc`` run
was reachable from the network. The local launcher points gloo (and NCCL's bootstrap) at the
loopback interface; every TCP socket a worker holds after a collective is then on a loopback
address.
"""

from __future__ import annotations

import ipaddress
import os
import sys

import pytest
import torch
import torch.distributed as dist

from paratrain.launch import loopback_interface
from tests.dist import run

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and /sys")


def _address(hex_addr: str) -> ipaddress._BaseAddress:
    """/proc/net/tcp{,6}'s local address (host byte order per 32-bit word) as an address."""
    raw = bytes.fromhex(hex_addr)
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def _own_tcp_addresses() -> list[str]:
    """Local addresses of this process's TCP sockets (listening or connected)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    found.append(str(_address(cols[1].split(":")[0])))
    return found


def _after_a_collective(env) -> tuple:
    t = torch.ones(1)
    dist.all_reduce(t)  # the pair's connection exists now
    return os.environ.get("GLOO_SOCKET_IFNAME"), _own_tcp_addresses(), float(t)


def test_local_workers_bind_gloo_to_loopback():
    for iface, addresses, total in run(_after_a_collective, 2, timeout=60):
        assert total == 2.0
        assert iface == loopback_interface() == "lo"
        assert addresses, "a gloo worker holds TCP sockets: the check must see them"
        assert all(ipaddress.ip_address(a).is_loopback for a in addresses), addresses
