"""The models a mesh serves, grouped from the live records: each with its nodes and its own host."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.proto import admission as adm
from meshllm.proto import crypto
from meshllm.proto import signed as sgn
from meshllm.proto import token as tok
from meshllm.proto.crypto import NodeId
from meshllm.proto.fleet import AVOID_S, Spread, model_groups, replica_wanted
from meshllm.proto.meshcore import MeshCore
from meshllm.proto.record import ModelFacts, NodeState, PeerRecord, Role

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


# ------------------------------------------------------------------------------------------------ replicas


@dataclass
class Mesh:
    """A founder's core (a lite client's view) and members' keys, ids and admission chains."""

    core: MeshCore
    now: float
    keys: list[Ed25519PrivateKey]
    ids: list[NodeId]
    chains: list[tuple[adm.Link, ...]]


def _members(n: int, scope: tok.Scope = tok.Scope.HOST, last: tok.Scope | None = None) -> Mesh:
    """``last``: the last member's scope, when another."""
    founder = crypto.new_key()
    now = time.time()
    chain = adm.found(founder, now)
    core = MeshCore(key=founder, mesh_id=chain[0][0], chain=chain, incarnation=1, now=now)
    keys = [crypto.new_key() for _ in range(n)]
    ids = [crypto.node_id(k) for k in keys]
    scopes = [scope] * (n - 1) + [last or scope]
    chains = [tuple(adm.admit(founder, chain, i, now, s)) for i, s in zip(ids, scopes, strict=True)]
    return Mesh(core, now, keys, ids, chains)


def test_a_whole_copy_the_host_s_plan_leaves_out_serves_a_replica() -> None:
    m = _members(3)
    ids, chains = m.ids, m.chains
    host = PeerRecord(ids[0], 1, 1, Role.HOST, model=X, chain=chains[0], planned=(ids[0], ids[1]))
    me = PeerRecord(ids[2], 1, 1, Role.WORKER, model=X, chain=chains[2])
    assert replica_wanted(me, host, fits_alone=True)
    assert replica_wanted(replace(me, role=Role.HOST, replica=True), host, fits_alone=True)  # stays one
    assert not replica_wanted(me, host, fits_alone=False)  # the model does not fit its memory alone
    assert not replica_wanted(me, replace(host, planned=(ids[0], ids[2])), fits_alone=True)  # the plan uses it
    assert not replica_wanted(me, replace(host, planned=()), fits_alone=True)  # a plan that waits for memory
    assert not replica_wanted(me, replace(host, role=Role.WORKER), fits_alone=True)  # elected, not hosting yet
    assert not replica_wanted(me, None, fits_alone=True)
    assert not replica_wanted(replace(me, held=((0, 18),)), host, fits_alone=True)  # a partial copy
    assert not replica_wanted(replace(me, model=Y), host, fits_alone=True)  # another model
    worker_scoped = replace(me, chain=_members(1, tok.Scope.WORKER).chains[0])
    assert not replica_wanted(worker_scoped, host, fits_alone=True)  # may not host: never a replica


def test_requests_spread_by_load_per_slot_and_avoid_a_host_that_just_failed() -> None:
    a = PeerRecord(N[1], 1, 1, Role.HOST, model=X, slots=(0, 4, 0, 512))
    b = PeerRecord(N[2], 1, 1, Role.HOST, model=X, slots=(0, 4, 0, 512), replica=True)
    s = Spread()
    assert s.pick([], 0.0) is None
    picked = []
    for _ in range(4):  # gossip says both idle: what this node sent and has not seen answered decides
        h = s.pick([a, b], 0.0)
        assert h is not None
        s.begin(h.node)
        picked.append(h.node)
    assert sorted(picked) == [N[1], N[1], N[2], N[2]], picked
    for n in picked:
        s.end(n)
    assert not s.in_flight
    busy_a = PeerRecord(N[1], 1, 2, Role.HOST, model=X, slots=(3, 4, 2, 512))  # others' requests, from gossip
    assert s.pick([busy_a, b], 0.0) == b
    big = PeerRecord(N[3], 1, 1, Role.HOST, model=X, slots=(4, 16, 0, 512), replica=True)  # per slot: less loaded
    assert s.pick([busy_a, b, big], 0.0) == b and s.pick([busy_a, big], 0.0) == big
    small = PeerRecord(N[4], 1, 1, Role.HOST, model=X, slots=(2, 2, 0, 512), replica=True)
    assert s.pick([small, big], 0.0) == big  # 4 of 16 slots busy is less loaded than 2 of 2
    s.fail(N[1], 10.0)  # its request failed: the others get requests while they serve
    assert s.pick([a, b], 11.0) == b
    assert s.pick([a], 11.0) == a  # ... but it is the only one: it is tried again
    assert s.pick([a, b], 10.0 + AVOID_S + 1) == a and N[1] not in s.failed  # forgotten after AVOID_S


def test_a_replica_is_never_the_sitting_host_and_is_routed_to_only_beside_the_elected_one() -> None:
    m = _members(4, last=tok.Scope.WORKER)
    core, now = m.core, m.now
    host, rep, _, liar = m.ids

    def put(i: int, seq: int, **kw: Any) -> None:
        r = PeerRecord(m.ids[i], 1, seq, model=X, chain=m.chains[i], state=NodeState.SERVING, **kw)
        core.table.merge_record(r.to_wire(m.keys[i]), now)
        core.on_connected(m.ids[i], now)

    # the replica's capacity is the largest: as a sitting host it would take the election from the host
    put(0, 1, role=Role.HOST, capacity=10, planned=(host,))
    put(1, 1, role=Role.HOST, capacity=12, replica=True)
    put(2, 1, role=Role.WORKER, capacity=1)
    got = core.hosts_for("x", now)
    elected = core.host_of(core.table.entries[host].record, now)
    assert elected is not None and elected.node == host
    assert [r.node for r in got] == [host, rep] and core.serving_host("x", now) == host
    assert core.hosts_for(None, now) == got and core.hosts_for("y", now) == []
    # a replica record the host's plan uses is stale (it is a worker there now): no request goes to it
    put(0, 2, role=Role.HOST, capacity=10, planned=(host, rep))
    assert [r.node for r in core.hosts_for("x", now)] == [host]
    assert model_groups(core.alive(now), lambda r: core.host_of(r, now))[0].replicas == ()
    # a record claiming to be a replica without saying it serves, or of a partial copy, gets nothing
    put(0, 3, role=Role.HOST, capacity=10, planned=(host,))
    put(1, 2, role=Role.HOST, capacity=12, replica=True, held=((0, 18),))
    assert [r.node for r in core.hosts_for("x", now)] == [host]
    groups = model_groups(core.alive(now), lambda r: core.host_of(r, now))
    assert groups[0].replicas == () and groups[0].nodes[0] == host
    put(1, 3, role=Role.HOST, capacity=12, replica=True)
    groups = model_groups(core.alive(now), lambda r: core.host_of(r, now))
    assert groups[0].replicas == (rep,) and groups[0].nodes[:2] == (host, rep)
    # a worker-scoped member that says it serves a replica (with any capacity) is none, and gets no request
    put(3, 1, role=Role.HOST, capacity=99, replica=True)
    assert model_groups(core.alive(now), lambda r: core.host_of(r, now))[0].replicas == (rep,)
    assert liar not in [r.node for r in core.hosts_for("x", now)]


def test_a_dropped_model_has_no_host_until_the_founder_or_an_admin_serves_it_again() -> None:
    """`mesh-llm drop NAME` / `serve NAME` — signed words, the newest per model counts; a dropped model is
    listed nowhere, elects no host (ours neither) and routes nowhere; a word by a non-admin, a forged one, or one for
    another mesh is refused; an admin's stops counting once the admin is revoked."""
    import dataclasses

    import pytest

    from meshllm.errors import RemoteProtocolError
    from meshllm.proto.gossip import GossipPush

    m = _members(3)
    core, now, mid = m.core, m.now, m.core.mesh_id
    for i, model in ((0, X), (1, Y), (2, Y)):
        r = PeerRecord(m.ids[i], 1, 1, Role.HOST if i < 2 else Role.WORKER, model=model, chain=m.chains[i],
                       capacity=5 - i, state=NodeState.SERVING)  # fmt: skip
        core.table.merge_record(r.to_wire(m.keys[i]), now)
        core.on_connected(m.ids[i], now)
    assert core.served_models(now) == ["x", "y"] and core.serving_host("y", now) == m.ids[1]
    drop = sgn.direct(core.key, mid, "y", False, now)
    core.revoke([], now, None, [drop])  # as `mesh-llm drop y` on the founder's machine
    assert core.served_models(now) == ["x"] and core.hosts_for("y", now) == [] and core.serving_host("y", now) is None
    assert core.hosts_for(None, now)[0].node == m.ids[0]
    assert [e.detail for e in core.events if e.kind == "directive"] == ["drop y"]
    # the newest word counts: an older serve changes nothing, a newer one brings it back
    older = sgn.direct(core.key, mid, "y", True, now - 5)
    assert not core.table.merge_push(GossipPush(directives=[older.to_wire()]), now).new_directives
    assert core.table.dropped("y")
    again = sgn.direct(core.key, mid, "y", True, now + 1)
    assert core.table.merge_push(GossipPush(directives=[again.to_wire()]), now).new_directives == [again]
    assert core.served_models(now) == ["x", "y"] and core.serving_host("y", now) == m.ids[1]
    # refused: a member that is no admin (signing or shipping it), a forged word, another mesh's
    with pytest.raises(ValueError, match="only the node that founded"):
        sgn.direct(m.keys[0], mid, "x", False, now + 2)
    by_member = sgn.Directive(mid, "x", False, int(now + 2), m.ids[0])
    by_member = dataclasses.replace(by_member, sig=crypto.sign(m.keys[0], crypto.D_DIRECTIVE, by_member.body()))
    forged = dataclasses.replace(sgn.direct(core.key, mid, "y", True, now + 2), model="x", serve=False)
    foreign_key = crypto.new_key()
    foreign = sgn.direct(foreign_key, adm.found(foreign_key, now)[0][0], "x", False, now + 2)
    res = core.table.merge_push(GossipPush(directives=[by_member.to_wire(), forged.to_wire(), foreign.to_wire()]),
                                now)  # fmt: skip
    assert len(res.dropped) == 3 and not res.new_directives and not core.table.dropped("x"), res.dropped
    with pytest.raises(RemoteProtocolError, match="malformed"):
        sgn.directive_from_wire([mid, "x", "no", 1, m.ids[0], b""], mid)
    # an admin's word counts while the admin stands
    core.revoke([], now, [sgn.grant_admin(core.key, mid, m.ids[0], now)])
    word = sgn.direct(m.keys[0], mid, "x", False, now + 3, admins={m.ids[0]})
    core.table.merge_push(GossipPush(directives=[word.to_wire()]), now)
    assert core.table.dropped("x") and core.served_models(now) == ["y"]
    core.revoke([sgn.revoke(core.key, mid, m.ids[0], now)], now)
    assert not core.table.dropped("x")


def test_a_node_serving_nothing_takes_up_the_model_asked_for_first_that_nobody_serves() -> None:
    from meshllm.proto.fleet import asked_for

    words = [("b", True, 20), ("a", True, 10), ("c", False, 5), ("d", True, 30)]
    assert asked_for(words, set()) == "a"  # asked for first
    assert asked_for(words, {"a"}) == "b"  # a node serves it already
    assert asked_for(words, {"a", "b", "d"}) is None  # a dropped model is no request to serve it
    assert asked_for([], set()) is None


def test_the_nodes_a_host_leaves_out_that_hold_the_model_only_together_form_a_second_split() -> None:
    """"As two splits": whole copies outside the elected host's plan, neither lite nor client-scoped nor
    able to hold it alone (those serve whole replicas); hosted by the host-scoped one with the most memory."""
    from meshllm.proto.fleet import left_out, split_replica_host

    m = _members(6, last=tok.Scope.WORKER)
    h, w1, r, w, big, ws = m.ids
    host = PeerRecord(h, 1, 1, Role.HOST, model=X, capacity=5, planned=(h, w1))
    client_scoped = _members(1, tok.Scope.CLIENT).chains[0]
    recs = [host, PeerRecord(w1, 1, 1, Role.WORKER, model=X, capacity=5, chain=m.chains[1]),
            PeerRecord(r, 1, 1, Role.WORKER, model=X, capacity=5, chain=m.chains[2]),
            PeerRecord(w, 1, 1, Role.WORKER, model=X, capacity=5, chain=m.chains[3]),
            PeerRecord(big, 1, 1, Role.WORKER, model=X, capacity=50, chain=m.chains[4]),  # holds it alone
            PeerRecord(ws, 1, 1, Role.WORKER, model=X, capacity=9, chain=m.chains[5]),  # worker-scoped
            PeerRecord(N[1], 1, 1, Role.WORKER, model=X, capacity=9, held=((0, 4),), chain=m.chains[1]),  # partial
            PeerRecord(N[2], 1, 1, Role.CLIENT, model=X, capacity=9, chain=m.chains[1]),  # a lite client
            PeerRecord(N[4], 1, 1, Role.WORKER, model=X, capacity=9, chain=client_scoped),
            PeerRecord(N[3], 1, 1, Role.WORKER, model=Y, capacity=9, chain=m.chains[1])]  # fmt: skip
    alone = lambda rec: rec.capacity >= 50  # noqa: E731
    left = left_out(host, recs, alone)
    assert {x.node for x in left} == {r, w, ws}
    got = split_replica_host(left)
    assert got is not None and got.node == min(r, w)  # same memory: the lower id (ws may not host, though larger)
    assert split_replica_host([x for x in left if x.node != min(r, w)]).node == max(r, w)  # type: ignore[union-attr]
    assert split_replica_host([x for x in left if x.node == ws]) is None
    assert left_out(replace(host, planned=()), recs, alone) == []  # a plan waiting for memory: nobody is left out
    assert left_out(replace(host, role=Role.WORKER), recs, alone) == [] and left_out(None, recs, alone) == []


def test_the_nodes_serving_a_replica_are_its_host_and_its_plan() -> None:
    from meshllm.proto.fleet import replica_nodes

    host = PeerRecord(N[0], 1, 1, Role.HOST, model=X, planned=(N[1], N[0]))
    split = PeerRecord(N[2], 1, 1, Role.HOST, model=X, replica=True, planned=(N[3], N[2]))
    whole = PeerRecord(N[4], 1, 1, Role.HOST, model=X, replica=True, planned=(N[4],))
    loading = PeerRecord(N[5], 1, 1, Role.WORKER, model=X, replica=True)  # not hosting (yet): no replica to end
    recs = [host, PeerRecord(N[1], 1, 1, Role.WORKER, model=X), split, whole, loading]
    assert replica_nodes(recs, N[0]) == {N[2], N[3], N[4]}
    assert replica_nodes(recs, N[2]) == {N[4]}  # the elected host itself is never one


def test_a_node_its_model_does_not_use_moves_to_a_model_that_waits_for_memory() -> None:
    """Demand: a --model auto node that serves a replica of x (or stands by) goes to y while y's host waits
    for memory; never from a model whose plan uses it or that waits itself (no bouncing between waiting models)."""
    from meshllm.proto.fleet import ModelGroup, move_to

    me = PeerRecord(N[3], 1, 1, Role.HOST, model=X, replica=True)
    x_host = PeerRecord(N[1], 1, 1, Role.HOST, model=X, planned=(N[1],))
    y_host = PeerRecord(N[2], 1, 1, Role.HOST, model=Y, why="waiting for more peers — need 2 GB, have 1 GB")
    gx, gy = ModelGroup("x", X.fingerprint, x_host, (N[1], N[3])), ModelGroup("y", Y.fingerprint, y_host, (N[2],))
    assert move_to(me, [gx, gy]) == gy
    assert move_to(replace(me, replica=False, role=Role.WORKER), [gx, gy]) == gy  # standing by
    assert move_to(me, [gx, replace(gy, host=replace(y_host, why=""))]) is None  # y serves: nothing waits
    assert move_to(me, [replace(gx, host=replace(x_host, planned=(N[1], N[3]))), gy]) is None  # x's plan uses it
    assert move_to(me, [replace(gx, host=replace(x_host, planned=())), gy]) is None  # x waits for memory itself
    assert move_to(replace(me, model=None), [gx, gy]) is None



def test_a_node_whose_election_settles_answers_a_sitting_host_that_plans_it() -> None:
    """A worker joining a mesh whose host already sits and plans it serves its layers for that host
    while its own election settles (before: it refused the host's key requests for those 2 s, on every new split).
    Not a host that does not sit, a replica, one whose plan leaves it out, nor once the election has settled."""
    from meshllm.proto.election import DEBOUNCE_S

    for role, replica, plans_me, expect in ((Role.HOST, False, True, True), (Role.WORKER, False, True, False),
                                            (Role.HOST, True, True, False), (Role.HOST, False, False, False)):
        m = _members(2)
        core, now = m.core, m.now
        core.update(now, model=X, role=Role.WORKER, capacity=1)
        planned = (core.me, m.ids[0]) if plans_me else (m.ids[0],)
        r = PeerRecord(m.ids[0], 1, 1, role, model=X, chain=m.chains[0], capacity=5, replica=replica, planned=planned)
        core.table.merge_record(r.to_wire(m.keys[0]), now)
        core.on_connected(m.ids[0], now)
        assert core.elected_host(now) is None  # the election settles for its 2 s, as before
        assert core.sitting_host_for_me(now) == (m.ids[0] if expect else None), (role, replica, plans_me)
        assert core.elected_host(now + DEBOUNCE_S + 0.1) == m.ids[0]
        assert core.sitting_host_for_me(now + DEBOUNCE_S + 0.2) is None  # settled: the elected one counts


def test_the_mesh_elects_a_gpu_node_over_a_cpu_node_with_more_memory() -> None:
    """C: the election every node runs over gossiped records reads a node's device: a GPU node beats a CPU
    node whose RAM is the larger figure."""
    m = _members(2)
    core, now = m.core, m.now
    for i, (cap, dev) in enumerate([(10, "cuda: NVIDIA H200"), (200, "cpu")]):
        r = PeerRecord(m.ids[i], 1, 1, model=X, chain=m.chains[i], role=Role.WORKER, capacity=cap, device=dev)
        core.table.merge_record(r.to_wire(m.keys[i]), now)
        core.on_connected(m.ids[i], now)
    assert core.elected_for(X.fingerprint, now) == m.ids[0]
