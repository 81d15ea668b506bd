"""[fleet] The models a mesh serves, grouped from the live records: each with its nodes and its own host."""

from __future__ import annotations

from meshllm.proto.fleet import model_groups
from meshllm.proto.gossip import ModelFacts, PeerRecord, Role

X, Y = ModelFacts("aa" * 32, 1, 18, "x"), ModelFacts("bb" * 32, 1, 18, "y")
N = [bytes([i]) * 32 for i in range(6)]


def test_each_model_has_its_nodes_and_its_own_host() -> None:
    recs = [PeerRecord(N[0], 1, 1, Role.HOST, model=X), PeerRecord(N[1], 1, 1, Role.WORKER, model=X),
            PeerRecord(N[2], 1, 1, Role.HOST, model=Y), PeerRecord(N[3], 1, 1, Role.CLIENT),
            PeerRecord(N[4], 1, 1, Role.WORKER, model=Y, held=((0, 3),)),
            PeerRecord(N[5], 1, 1, Role.CLIENT, model=Y)]  # a lite client's record holds no model it serves
    hosts = {X.fingerprint: recs[1], Y.fingerprint: recs[2]}  # the election's answer: x hosted by N1
    got = model_groups(recs, lambda r: hosts[r.model.fingerprint] if r.model else None)
    assert [(g.name, g.fingerprint) for g in got] == [("x", X.fingerprint), ("y", Y.fingerprint)]
    assert got[0].host == recs[1] and got[0].nodes == (N[1], N[0])  # its host first
    assert got[1].host == recs[2] and got[1].nodes == (N[2], N[4])  # a partial copy is one of its nodes
    # no host yet (or one of another model): None, the nodes in id order
    none = model_groups(recs[:2], lambda r: recs[2])
    assert none[0].host is None and none[0].nodes == (N[0], N[1])


def test_a_node_without_a_model_joins_the_one_that_needs_it_most() -> None:
    from dataclasses import replace

    from meshllm.proto.fleet import ModelGroup, neediest

    h = PeerRecord(N[0], 1, 1, Role.HOST, model=X)
    calm, busy = ModelGroup("a", "1", h, (N[0],)), ModelGroup("b", "2", replace(h, slots=(4, 4, 0, 0)), (N[1],))
    queued = ModelGroup("c", "3", replace(h, slots=(1, 4, 2, 0)), (N[2],))
    waiting = ModelGroup("d", "4", replace(h, why="waiting for more peers — need 9.0 GB, have 4.0 GB"), (N[3],))
    hostless = ModelGroup("e", "5", None, (N[4],))
    assert neediest([calm, busy, queued, waiting, hostless]) == waiting  # memory first
    assert neediest([calm, busy, queued, hostless]) == queued  # then requests waiting for a slot
    assert neediest([calm, busy]) == busy and neediest([busy, replace(busy, name="a")]).name == "a"  # type: ignore[union-attr]
    assert neediest([hostless]) is None and neediest([]) is None
