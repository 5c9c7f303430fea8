"""Local workers listen on loopback only (issue 23, item 6, "Paths and addresses"); so do
torchrun ranks on one host and a store rank 0 hosts (issue 35, item 11).

gloo binds its sockets to the address the host name resolves to unless GLOO_SOCKET_IFNAME names an
interface; on a machine whose host name resolves to its network address, a local ``--nproc`` run
was reachable from the network. The local launcher points gloo (and NCCL's bootstrap) at the
loopback interface; every TCP socket a worker holds after a collective is then on a loopback
address.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist

from paratrain.launch import _torchrun_store, bind_loopback_on_one_host, loopback_interface
from tests import netprobe
from tests.dist import run

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and /sys")


def _after_a_collective(env) -> tuple:
    t = torch.ones(1)
    dist.all_reduce(t)  # the pair's connection exists now
    return os.environ.get("GLOO_SOCKET_IFNAME"), [address for address, _ in netprobe.tcp_sockets()], float(t)


def test_local_workers_bind_gloo_to_loopback():
    for iface, addresses, total in run(_after_a_collective, 2, timeout=60):
        assert total == 2.0
        assert iface == loopback_interface() == "lo"
        assert addresses, "a gloo worker holds TCP sockets: the check must see them"
        assert all(ipaddress.ip_address(a).is_loopback for a in addresses), addresses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_store_rank_0_hosts_listens_on_master_addr_only(monkeypatch):
    """Issue 35 item 11: started with RANK/WORLD_SIZE/MASTER_ADDR but no torchrun agent, rank 0
    hosts the TCP store, and a TCPStore left to itself listens on every interface (``*``), so a
    run named on loopback was reachable from the network. It listens on MASTER_ADDR only now."""
    port = _free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store = _torchrun_store(0, 1, datetime.timedelta(seconds=10))
    store.set("k", "v")
    assert store.get("k") == b"v"
    on_port = [address for address, p in netprobe.listening("self") if p == port]
    assert on_port == ["127.0.0.1"], on_port
    del store


def test_torchrun_on_one_host_listens_on_loopback(monkeypatch):
    """Under torchrun with MASTER_ADDR on loopback (``--standalone``) every rank is on this host:
    gloo and NCCL's bootstrap are pointed at loopback, not at the address the host name resolves
    to (a LAN address on most machines). A multi-node address, or an interface the user named,
    is left alone."""
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET-1: another machine's address
    bind_loopback_on_one_host()
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    bind_loopback_on_one_host()
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface()
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
