"""Collectives on a link: the alpha-beta model of ring collectives, or the link's measured curve.

On n ranks moving M bytes: all-reduce 2(n-1) alpha + 2(n-1)/n M/beta; all-gather and
reduce-scatter (n-1) alpha + (n-1)/n M/beta; point-to-point alpha + M/beta; all-to-all (pairwise
exchange) as all-gather. A link measured on this machine (planner/machine.py ``_loopback``)
replaces alpha-beta by its curve for the kinds it measured. A group uses the intra-node link if it
fits in one node (tp ranks are neighbours, then dp, then pp), otherwise the inter-node link
(``group_link``).

A ring across nodes (``spanning_latency``, ``spanning_bandwidth_time``; ZeRO-3, planner/zero3.py)
is priced as NCCL's own tuning model prices it (NVIDIA/nccl src/graph/tuning.cc,
``ncclTopoTuneModel``): a fixed launch latency plus one hop latency per ring step, the n - 1 steps
of an all-gather or reduce-scatter split into nNodes - 1 steps that cross a node boundary (the
network's hop latency) and the rest inside nodes (NVLink's); its bandwidth is the node's NIC share
the ring's ranks in that node carry together (``ring_link``). So a collective of a unit over
hundreds of ranks is latency-bound when its per-rank piece (unit / n) is small, and
bandwidth-bound by the node's NIC when it is large.
"""

from __future__ import annotations

from dataclasses import replace

from paratrain.perf.hardware import Cluster, Link
from paratrain.planner.memory import Layout


def measured_time(kind: str, nbytes: float, n: int, link: Link) -> float | None:
    """Seconds of one `kind` collective of `nbytes` payload from the link's measured curve (the
    local machine), or None when the link has none: linear between the measured sizes, the last
    segment's slope beyond the largest, the smallest's time below it. A group of n ranks other than
    the measured one scales by the ring's hop count, (n - 1) / (measured - 1)."""
    curve = link.curve(kind)
    if curve is None:
        return None
    ranks, points = curve
    points = sorted(points)
    if nbytes <= points[0][0]:
        t = points[0][1]
    else:
        (b0, t0), (b1, t1) = next(((a, b) for a, b in zip(points, points[1:]) if nbytes <= b[0]),
                                  tuple(points[-2:]))
        t = t0 + (nbytes - b0) * max(t1 - t0, 0.0) / (b1 - b0)
    return t * (n - 1) / max(ranks - 1, 1)


def _ring_time(kind: str, passes: int, nbytes: float, n: int, link: Link) -> float:
    """A ring collective of ``passes`` trips around n ranks: measured where the link has a table."""
    if n <= 1:
        return 0.0
    measured = measured_time(kind, nbytes, n, link)
    if measured is not None:
        return measured
    return passes * ((n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth)


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """A reduce-scatter then an all-gather: two trips around the ring."""
    return _ring_time("all_reduce", 2, nbytes, n, link)


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """nbytes: the full (gathered) tensor; reduce-scatter costs the same."""
    return _ring_time("all_gather", 1, nbytes, n, link)


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """nbytes: the full (input) tensor."""
    if n <= 1:
        return 0.0
    measured = measured_time("reduce_scatter", nbytes, n, link)
    return all_gather_time(nbytes, n, link) if measured is None else measured


def p2p_time(nbytes: float, link: Link) -> float:
    measured = measured_time("send", nbytes, 2, link)
    return link.latency + nbytes / link.bandwidth if measured is None else measured


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """nbytes: one rank's whole buffer; it keeps 1/n and sends (n-1)/n of it, one message to each
    of the n - 1 others (pairwise exchange)."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def group_link(cluster: Cluster, lay: Layout, axis: str) -> Link:
    """The link a group's ring crosses: ranks are laid out tp fastest, then dp, then pp, so a
    group of `size` ranks at stride `stride` spans stride * size consecutive ranks. ep groups are
    neighbours inside dp (stride tp), edp groups stride over them (tp * ep); cp groups are
    neighbours inside dp too (mesh.py: ``dp_index = batch_index * cp + cp_index``), batch groups (the
    rank at one cp index in every data replica) stride over them (tp * cp)."""
    stride, size = {"tp": (1, lay.tp), "dp": (lay.tp, lay.dp), "pp": (lay.tp * lay.dp, lay.pp),
                    "ep": (lay.tp, lay.ep), "edp": (lay.tp * lay.ep, lay.edp), "cp": (lay.tp, lay.cp),
                    "batch": (lay.tp * lay.cp, lay.replicas)}[axis]
    if stride * size <= cluster.devices_per_node:
        return cluster.intra
    return cluster.inter


def ring_link(cluster: Cluster, lay: Layout, axis: str) -> Link:
    """The link a data-parallel ring runs at. Within a node: the intra link. Across nodes, a group
    with g ranks in each node crosses each node boundary on g rings at once (NCCL's channels), one
    per rank's own share of the node's inter-node bandwidth, so its ring moves min(intra, g x inter)
    per rank (the hierarchical bound); g = 1 (one rank per node, e.g. hybrid sharding's replicas):
    the inter link itself. Charging every byte of a flat ring at one rank's inter share overstated
    DDP/ZeRO across nodes g-fold (and hybrid sharding's gain over them with it)."""
    link = group_link(cluster, lay, axis)
    if link is cluster.intra:
        return link
    stride = {"dp": lay.tp, "edp": lay.tp * lay.ep, "batch": lay.tp * lay.cp}[axis]
    per_node = max(1, cluster.devices_per_node // stride)
    if per_node == 1:
        return link
    return replace(link, bandwidth=min(cluster.intra.bandwidth, per_node * link.bandwidth))


# NCCL's fixed latency of a ring collective with the Simple protocol (the one it picks for large
# messages): baseLat[Ring][Simple] = 8.4 us in src/graph/tuning.cc (NVIDIA/nccl, commit 01afd20);
# its per-hop figures there are hwLat NVLink 3.4 us and network 9.6 us per ring step.
NCCL_RING_BASE_LATENCY = 8.4e-6


def spanned_nodes(cluster: Cluster, lay: Layout, axis: str) -> int:
    """Nodes one group of `axis` spans (its ranks laid out as ``group_link`` describes)."""
    stride, size = {"dp": (lay.tp, lay.dp), "edp": (lay.tp * lay.ep, lay.edp)}[axis]
    if stride >= cluster.devices_per_node:  # every rank of the group in a node of its own
        return size
    return -(-stride * size // cluster.devices_per_node)


def spanning_latency(n: int, nodes: int, cluster: Cluster) -> float:
    """Seconds of latency of one ring all-gather or reduce-scatter of n ranks over `nodes` nodes
    (NCCL's model): the base, nodes - 1 network steps at the inter link's hop latency, the other
    n - nodes steps at the intra link's."""
    if n <= 1:
        return 0.0
    inter_steps = min(nodes, n) - 1
    intra_steps = n - 1 - inter_steps
    return NCCL_RING_BASE_LATENCY + inter_steps * cluster.inter.latency + intra_steps * cluster.intra.latency


def spanning_bandwidth_time(nbytes: float, n: int, cluster: Cluster, lay: Layout, axis: str = "dp") -> float:
    """Seconds the ring needs to move an all-gather's or reduce-scatter's (n - 1)/n x nbytes through
    its slowest link: across nodes the node's NIC share of the ring's ranks there (``ring_link``)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / ring_link(cluster, lay, axis).bandwidth
