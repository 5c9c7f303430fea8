"""The mesh: rank <-> coordinates, the groups of each axis, and real process groups."""

import pytest
import torch

from paratrain.comm import collectives as C
from paratrain.mesh import MeshError, MeshShape, ParallelMesh
from tests.dist import run


def test_tp_varies_fastest_then_dp_then_pp():
    s = MeshShape(pp=2, dp=2, tp=2)
    assert s.coords(0) == {"pp": 0, "dp": 0, "tp": 0, "ep": 0, "edp": 0, "dp_shard": 0, "dp_replicate": 0,
                           "edp_shard": 0, "edp_replicate": 0, "cp": 0, "batch": 0, "world": 0}
    assert s.coords(1)["tp"] == 1 and s.coords(2)["dp"] == 1 and s.coords(4)["pp"] == 1
    for r in range(8):
        c = s.coords(r)
        assert s.rank_of(c["pp"], c["dp"], c["tp"]) == r


def test_cp_subdivides_dp_neighbours_share_rows():
    """dp x cp = 4 with cp 2, tp 2: cp groups are neighbouring dp indices (same rows), the dp axis
    (gradient sums, ZeRO shards) spans all four, the batch axis the same cp index of each batch."""
    s = MeshShape(dp=4, tp=2, cp=2)
    assert sorted(s.groups("cp")) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert s.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [s.coords(r)["batch"] for r in (0, 2, 4, 6)] == [0, 0, 1, 1]
    # averaging replicas that are cp groups meet over batch: the same cp index of every batch
    assert sorted(s.groups("batch")) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert MeshShape(dp=4).groups("batch") == MeshShape(dp=4).groups("dp")  # cp 1: the dp group
    with pytest.raises(MeshError, match="cp"):
        MeshShape(dp=3, cp=2).check(3)


@pytest.mark.parametrize("pp,dp,tp", [(1, 4, 1), (1, 2, 2), (2, 2, 2), (2, 1, 4), (4, 2, 1)])
def test_groups_partition_the_world(pp, dp, tp):
    s = MeshShape(pp=pp, dp=dp, tp=tp)
    for axis, size in (("pp", pp), ("dp", dp), ("tp", tp)):
        groups = s.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(s.world_size))
        assert all(len(g) == size for g in groups)
        for g in groups:  # members differ only along `axis`, in axis order
            coords = [s.coords(r) for r in g]
            assert [c[axis] for c in coords] == list(range(size))
            for other in {"pp", "dp", "tp"} - {axis}:
                assert len({c[other] for c in coords}) == 1


def test_hybrid_sharding_subdivides_dp():
    """dp 4 = 2 replicas x 2 shards: shard groups are dp neighbours (one node), replicate groups pair
    the same shard index of each replica; with tp 2 every group holds one tp index."""
    s = MeshShape(dp=4, tp=2, dp_replicate=2)
    assert s.dp_shard == 2
    assert sorted(s.groups("dp_shard")) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(s.groups("dp_replicate")) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert MeshShape(dp=4).groups("dp_shard") == MeshShape(dp=4).groups("dp")
    with pytest.raises(MeshError, match="dp_replicate\\(3\\) must divide dp\\(4\\)"):
        MeshShape(dp=4, dp_replicate=3).check(4)


def _hybrid_sums(env):
    mesh = ParallelMesh(MeshShape(dp=4, dp_replicate=2), env.rank)
    shard = torch.tensor([float(env.rank)])
    C.all_reduce(shard, mesh.dp_shard)
    replica = torch.tensor([float(env.rank)])
    C.all_reduce(replica, mesh.dp_replicate)
    return shard.item(), replica.item(), mesh.dp_shard.group is mesh.dp.group


def test_hybrid_groups_reduce_over_their_members():
    got = run(_hybrid_sums, 4)
    assert [g[:2] for g in got] == [(1.0, 2.0), (1.0, 4.0), (5.0, 2.0), (5.0, 4.0)]
    assert not any(g[2] for g in got)


def test_experts_under_hybrid_sharding_split_edp_like_dp():
    """dp 8 = R2 x S4 with ep 2: a replica (ranks 0-3, 4-7) holds every expert over its ep pairs;
    an expert's edp ranks (same ep index) split into the replica's (edp_shard) and the copies of
    its shard across the replicas (edp_replicate). Without replicas edp_shard is edp."""
    s = MeshShape(dp=8, ep=2, dp_replicate=2)
    assert s.groups("edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert sorted(s.groups("edp_shard")) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(s.groups("edp_replicate")) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [s.coords(r)["edp_shard"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    plain = MeshShape(dp=4, ep=2)
    assert plain.groups("edp_shard") == plain.groups("edp")
    assert sorted(plain.groups("edp_replicate")) == [[r] for r in range(4)]


def test_2x2x2_groups_explicitly():
    s = MeshShape(pp=2, dp=2, tp=2)
    assert s.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert s.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert s.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_expert_parallel_subdivides_dp():
    s = MeshShape(dp=4, ep=2)
    assert s.groups("ep") == [[0, 1], [2, 3]]
    assert s.groups("edp") == [[0, 2], [1, 3]]


def test_degree_mismatch_names_the_numbers():
    with pytest.raises(MeshError, match=r"dp\(2\) \* tp\(3\) \* pp\(1\) = 6 != world size 4"):
        MeshShape(dp=2, tp=3).check(4)
    with pytest.raises(MeshError, match=r"ep\(3\) must divide dp\(4\)"):
        MeshShape(dp=4, ep=3).check(4)


def _axis_members(env):
    mesh = ParallelMesh(MeshShape(pp=2, dp=2, tp=2), env.rank)
    out = {}
    for name in ("pp", "dp", "tp", "world"):
        axis = mesh.axes[name]
        # all_gather of our rank along the axis proves the group really connects those ranks
        got = C.all_gather_list(torch.tensor([env.rank]), axis)
        out[name] = [int(t) for t in got]
    return out, dict(mesh.counter.payload)


def test_process_groups_connect_the_right_ranks():
    results = run(_axis_members, 8, timeout=120)
    s = MeshShape(pp=2, dp=2, tp=2)
    for rank, (members, payload) in enumerate(results):
        for name in ("pp", "dp", "tp"):
            assert members[name] == next(g for g in s.groups(name) if rank in g)
        assert members["world"] == list(range(8))
        # 4 gathers of one int64 from 2 ranks (pp, dp, tp) + 8 ranks (world) = 8*(2+2+2+8) bytes
        assert payload == {"all_gather": 8 * (2 + 2 + 2 + 8)}
