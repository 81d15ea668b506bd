"""The serving core: where a request goes, which llama-server a plan wants, who may open RPC, which of
two connections survives. Pure functions, each with its negative cases."""

from __future__ import annotations

from dataclasses import replace

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from meshllm.proto import serving as s
from meshllm.proto.layout import Assignment, Plan, Waiting

ME, HOST, W1, W2, STRANGER = (bytes([i]) * 32 for i in (5, 9, 1, 2, 7))
SOLO = Plan(ME, (Assignment(ME, 0, 18, 600),), ())
SPLIT = Plan(ME, (Assignment(W1, 0, 6, 200), Assignment(W2, 6, 6, 200), Assignment(ME, 12, 6, 200)), ())


def route(requested: str | None = None, **kw: object) -> s.Route:
    args: dict[str, object] = {
        "served": ["tiny"], "local": None, "remote": None, "remote_listener_ready": False, "plan": None,
        "host": None, "me": ME,
    }  # fmt: skip
    args.update(kw)
    return s.route(requested, **args)  # type: ignore[arg-type]


def test_route_prefers_our_own_serving_llama_server() -> None:
    local = s.LocalServing("tiny", "serving")
    assert route(None, local=local) == s.Local("tiny")
    assert route("tiny", local=local, remote=(HOST, "tiny"), remote_listener_ready=True) == s.Local("tiny")


def test_route_refuses_a_model_nobody_serves() -> None:
    assert route("other", local=s.LocalServing("tiny", "serving")) is None
    # while nobody announces anything yet, any name is let through to the 503 branches
    assert isinstance(route("other", served=[]), s.Busy)


def test_route_goes_to_the_host_serving_another_model() -> None:
    local = s.LocalServing("tiny", "serving")
    got = route("big", served=["tiny", "big"], local=local, remote=(HOST, "big"), remote_listener_ready=True)
    assert got == s.Remote(HOST, "big")
    assert route(None, remote=(HOST, "tiny"), remote_listener_ready=True) == s.Remote(HOST, "tiny")


def test_route_without_a_listener_opens_one_and_answers_503_for_a_second() -> None:
    assert route(None, remote=(HOST, "tiny")) == s.Connecting(HOST, retry_after_s=1)


def test_route_says_why_it_cannot_serve() -> None:
    assert route(None, local=s.LocalServing("tiny", "loading", "restarting in 2 s")) == s.Busy("restarting in 2 s")
    assert route(None, local=s.LocalServing("tiny", "failed")) == s.Busy("the model is failed")
    # a loading local server wins over a remote one: the host is us
    assert isinstance(route(None, local=s.LocalServing("tiny", "loading"), remote=(HOST, "tiny")), s.Busy)
    waiting = Waiting(int(0.6e9), int(0.3e9))
    assert route(None, plan=waiting, host=ME) == s.Busy(waiting.message())
    assert route(None) == s.Busy("no host elected yet: waiting for peers")
    assert route(None, host=HOST).reason.startswith("connecting to the host")  # type: ignore[union-attr]
    assert route(None, host=ME, plan=SOLO) == s.Busy("starting the model server")
    assert all(b.retry_after_s == 5 for b in [route(None), route(None, host=HOST)])  # type: ignore[union-attr]


def want(plan: Plan | Waiting | None, **kw: object) -> s.ServerWant:
    args: dict[str, object] = {"can_host": True, "listeners": frozenset(), "connected": frozenset()}
    args.update(kw)
    return s.wanted_server(plan, ME, **args)  # type: ignore[arg-type]


def test_server_wanted_only_when_we_host_a_plan_and_can() -> None:
    assert want(None) is None
    assert want(Waiting(1, 0)) is None
    assert want(Plan(HOST, (Assignment(HOST, 0, 18, 1),), ())) is None  # someone else hosts
    assert want(SOLO, can_host=False) is None  # no binaries or no model file
    assert want(SOLO) == s.Solo()


def test_a_split_waits_for_tunnels_and_connections() -> None:
    assert want(SPLIT) == s.NeedTunnels((W1, W2))
    assert want(SPLIT, listeners=frozenset({W1})) == s.NeedTunnels((W2,))
    assert want(SPLIT, listeners=frozenset({W1, W2}), connected=frozenset({W1})) == s.NeedTunnels(())
    got = want(SPLIT, listeners=frozenset({W1, W2}), connected=frozenset({W1, W2, STRANGER}))
    # workers in plan order; our own rpc-server goes last; the host's entry counts the output layer too
    assert got == s.Split((W1, W2), (6, 6, 7), own_rpc=True)
    # a GPU host runs its layers in-process (llama.cpp puts its GPU after the RPC devices): no hop to itself
    gpu = want(SPLIT, listeners=frozenset({W1, W2}), connected=frozenset({W1, W2}), has_accelerator=True)
    assert gpu == s.Split((W1, W2), (6, 6, 7), own_rpc=False)
    # the plan's placement of the token embedding (patch 0013) reaches llama-server's configuration
    embd = want(replace(SPLIT, embd_first=True), listeners=frozenset({W1, W2}), connected=frozenset({W1, W2}))
    assert embd == s.Split((W1, W2), (6, 6, 7), own_rpc=True, embd_first=True)


def test_a_split_waits_for_its_workers_to_elect_the_host() -> None:
    """A worker that has not elected us yet refuses our llama-server's connections (it would fail at its first): the
    split waits for its record to name us, HOST_WAIT_S at most."""
    names = {W1: ME, W2: HOST}
    assert s.not_electing(SPLIT, ME, names.get) == {W2}
    assert s.not_electing(SPLIT, ME, {W1: ME, W2: ME}.get) == frozenset()
    assert s.not_electing(SPLIT, ME, {}.get) == {W1, W2}  # records that name no host (yet, or an older version)
    assert s.not_electing(SPLIT, HOST, {}.get) == frozenset()  # not our plan to host
    assert s.not_electing(Waiting(1, 0), ME, {}.get) == frozenset()
    up = {"listeners": frozenset({W1, W2}), "connected": frozenset({W1, W2})}
    assert want(SPLIT, electing=frozenset({W2}), **up) == s.NeedElected((W2,))
    assert want(SPLIT, lacking=frozenset({W1}), electing=frozenset({W2}), **up) == s.NeedLayers((W1,))
    assert want(SPLIT, electing=frozenset({STRANGER}), **up) == s.Split((W1, W2), (6, 6, 7), own_rpc=True)
    patience = s.LayerWait(s.HOST_WAIT_S)
    assert patience.step(frozenset({W2}), 100.0)[0] == {W2}
    assert patience.step(frozenset({W2}), 100.0 + s.HOST_WAIT_S)[0] == frozenset()  # then it starts anyway


def test_rpc_admission() -> None:
    assert s.may_open_rpc(HOST, HOST, True)
    assert not s.may_open_rpc(HOST, HOST, False)  # our rpc-server is down
    assert not s.may_open_rpc(None, HOST, True)  # unauthenticated
    assert not s.may_open_rpc(STRANGER, HOST, True)  # a member that is not the host we elected
    assert not s.may_open_rpc(STRANGER, None, True)  # no host elected yet
    assert not s.may_open_rpc(None, None, True)


NODES = st.binary(min_size=32, max_size=32)


@given(
    a=NODES, b=NODES, a_direct=st.booleans(), b_direct=st.booleans(), x_first_at=st.tuples(st.booleans(), st.booleans())
)
def test_both_ends_keep_the_same_one_of_two_connections(
    a: bytes, b: bytes, a_direct: bool, b_direct: bool, x_first_at: tuple[bool, bool]
) -> None:
    """Connection 'x' dialled by a, 'y' dialled by b (both dialled at once). Each end may see them arrive in either
    order; both must keep the same one."""
    if a == b:
        return
    direct = {"x": a_direct, "y": b_direct}
    dialler = {"x": a, "y": b}

    def kept(me: bytes, peer: bytes, existing: str) -> str:
        new = "y" if existing == "x" else "x"
        keep = s.keep_existing(direct[existing], direct[new], dialler[existing] == me, me, peer)
        return existing if keep else new

    at_a = kept(a, b, "x" if x_first_at[0] else "y")
    at_b = kept(b, a, "x" if x_first_at[1] else "y")
    assert at_a == at_b
    if a_direct != b_direct:
        assert direct[at_a]  # a direct connection beats a relayed one
    else:
        assert dialler[at_a] == s.designated_dialler(a, b) == min(a, b)


def test_a_peer_that_dials_again_lost_its_first_connection_and_the_new_one_stays() -> None:
    """A node killed -9 and started again at once dials its peers while they still hold the dead connection (QUIC
    notices only at its idle timeout); they kept the dead one by the dialler rule and the restarted node got no
    gossip for 30 s and more. Both ends now keep the new one (the restarted end has no other)."""
    a, b = min(ME, HOST), max(ME, HOST)
    for me, peer in ((a, b), (b, a)):
        for old_mine in (True, False):  # both dialled by me, or both by the peer
            assert not s.keep_existing(True, True, old_mine, me, peer, new_dialled_by_me=old_mine)
    # a race of one dial each way still goes by the dialler rule, the same at both ends
    assert s.keep_existing(True, True, True, a, b, new_dialled_by_me=False)
    assert s.keep_existing(True, True, False, b, a, new_dialled_by_me=True)  # a's dial, at b too
    assert s.keep_existing(True, False, True, a, b, new_dialled_by_me=True)  # direct beats relayed


def test_the_direct_path_is_tried_only_where_it_can_work() -> None:
    ok = dict(mode="auto", tls_here=True, quic_direct=True, ip="10.0.0.2", failed_until=None, now=100.0)
    assert s.try_direct(**ok)  # type: ignore[arg-type]
    for change in (
        {"mode": "tunnel"},  # --rpc-path tunnel
        {"tls_here": False},  # a build without patch 0005's TLS
        {"quic_direct": False},  # relayed: behind a NAT the worker's TCP port is out of reach
        {"ip": ""},
        {"failed_until": 160.0},  # failed lately
    ):
        assert not s.try_direct(**{**ok, **change}), change  # type: ignore[arg-type]
    assert s.try_direct(**{**ok, "failed_until": 100.0})  # type: ignore[arg-type]
    assert s.try_direct(**{**ok, "ip": "fd00::2"})  # type: ignore[arg-type]  # IPv6 too (patch 0012)


def test_an_rpc_key_round_trips_and_anything_else_is_refused() -> None:
    k = s.RpcKey("38b4552d-1-2", bytes(range(32)), 40123)
    assert s.RpcKey.decode(k.encode()) == k
    k = s.RpcKey("38b4552d-1-2", bytes(range(32)), 40123, peer=40124)  # with a predecessor listener (0011)
    assert s.RpcKey.decode(k.encode()) == k
    older = msgpack.packb({"id": "x", "key": bytes(32), "port": 5})  # a worker from before 0011: no listener
    assert s.RpcKey.decode(older) == s.RpcKey("x", bytes(32), 5, 0)
    bad = [
        b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"id": "x"}),
        msgpack.packb({"id": "a b", "key": bytes(32), "port": 1}),  # a blank would split the key file's line
        msgpack.packb({"id": "x", "key": bytes(16), "port": 1}),  # not 32 bytes
        msgpack.packb({"id": "x", "key": bytes(32), "port": 0}),
        msgpack.packb({"id": "x", "key": bytes(32), "port": True}),
        msgpack.packb({"id": "x\n", "key": bytes(32), "port": 5}),
        msgpack.packb({"id": "x" * 65, "key": bytes(32), "port": 5}),
        msgpack.packb({"id": "x", "key": bytes(32), "port": 5, "peer": 70000}),
        msgpack.packb({"id": "x", "key": bytes(32), "port": 5, "peer": "1"}),
    ]  # fmt: skip
    for raw in bad:
        assert s.RpcKey.decode(raw) is None, raw


@given(st.binary(max_size=200))
def test_rpc_key_decode_never_raises(raw: bytes) -> None:
    s.RpcKey.decode(raw)


def test_a_worker_llama_server_could_not_reach_goes_through_its_tunnel() -> None:
    a, b = bytes([1]) * 32, bytes([2]) * 32
    direct = {a: "10.0.0.2:5000", b: "10.0.0.3:5000"}
    tail = "load...\n../src/ggml/src/ggml-rpc/ggml-rpc.cpp:580: Failed to connect to 10.0.0.3:5000\n"
    assert s.unreachable_workers(tail, direct) == [b]
    assert s.unreachable_workers("Remote RPC server crashed or returned malformed response", direct) == []
    assert s.unreachable_workers("Failed to connect to 10.0.0.3:50001", direct) == []  # another port: not b's


def test_every_node_keeps_the_hosts_plan_first() -> None:
    """A node used to prefer the nodes of its own last plan: two nodes that saw joins in a different order
    kept two different plans for good (the mesh test waited 30 s for one plan)."""
    mine = Plan(HOST, (Assignment(W1, 0, 4, 1), Assignment(HOST, 4, 6, 1)), ())
    assert s.keep_first(HOST, HOST, mine, ()) == {W1, HOST}  # the host: the plan it runs
    assert s.keep_first(W1, HOST, mine, (W2, HOST)) == {W2, HOST}  # the others: the host's, not their own
    assert s.keep_first(W1, HOST, None, ()) == set()


def test_a_lite_client_gives_the_hosts_own_reason() -> None:
    """A lite client said "no host elected yet" (before: "the model server failed: ServerDisconnectedError")
    where the host knew it was waiting for more peers; the host's record says why, and every node says the same."""
    why = "the host 0a0a0a0a is waiting for more peers — need 0.6 GB, have 0.3 GB"
    assert route(None, host=None, host_says=why) == s.Busy(why)
    assert route(None, host=None) == s.Busy("no host elected yet: waiting for peers")
    assert route(None, remote=(HOST, "tiny"), remote_listener_ready=True, host_says=why) == s.Remote(HOST, "tiny")


def test_a_split_waits_for_workers_still_fetching_their_layers() -> None:
    """A worker with a partial copy that lacks a layer the plan gives it holds the split back (or the
    host would push those weights over the network); one holding them, or the whole file, does not."""
    up = {"listeners": frozenset({W1, W2}), "connected": frozenset({W1, W2})}
    assert want(SPLIT, lacking=frozenset({W2, STRANGER}), **up) == s.NeedLayers((W2,))
    assert want(SPLIT, lacking=frozenset({STRANGER}), **up) == s.Split((W1, W2), (6, 6, 7), own_rpc=True)
    assert want(SPLIT, lacking=frozenset({W1})) == s.NeedTunnels((W1, W2))  # tunnels first, as before
    held: dict[bytes, tuple[tuple[int, int], ...] | None] = {W1: None, W2: ((6, 3),)}  # W2's share: 6-11
    assert s.lacking_layers(SPLIT, held.get) == {W2}
    held[W2] = ((5, 2), (8, 4))  # lacks 7
    assert s.lacking_layers(SPLIT, held.get) == {W2}
    held[W2] = ((0, 1), (6, 2), (8, 4))
    assert s.lacking_layers(SPLIT, held.get) == frozenset()
    held[W1] = ()  # a partial copy with no layer yet
    assert s.lacking_layers(SPLIT, held.get) == {W1}
    assert s.lacking_layers(Waiting(1, 0), held.get) == frozenset() == s.lacking_layers(None, held.get)
    assert s.as_ranges([3, 1, 2, 7, 8, 3]) == ((1, 3), (7, 2)) and s.as_ranges([]) == ()
    assert s.covers(((1, 3), (7, 2)), 2, 2) and not s.covers(((1, 3), (7, 2)), 3, 2) and s.covers((), 5, 0)


def test_the_host_waits_for_a_worker_s_layers_a_bounded_time() -> None:
    w = s.LayerWait(limit_s=10)
    assert w.step(frozenset({W1, W2}), 0) == ({W1, W2}, [W1, W2], [])
    assert w.step(frozenset({W1, W2}), 5) == ({W1, W2}, [], [])
    assert w.step(frozenset({W2}), 6) == ({W2}, [], [])  # W1 has its layers
    assert w.step(frozenset({W2}), 10) == (frozenset(), [], [W2])  # waited long enough: said once
    assert w.step(frozenset({W2}), 11) == (frozenset(), [], [])
    assert w.step(frozenset({W1}), 12) == ({W1}, [W1], [])  # W1 lacks layers again (a new plan): a new wait
    assert w.step(frozenset(), 13) == (frozenset(), [], []) and w.step(frozenset({W2}), 14) == ({W2}, [W2], [])


def test_tunnel_peer_entries_name_each_forwarder_on_loopback_or_nothing() -> None:
    """Over the mesh: a worker's entry is the port on its predecessor's machine that leads to it; the
    first worker's says only its address (127.0.0.1: where its own connections come from at its successor)."""
    a, b, c = (bytes([i]) * 32 for i in (1, 2, 3))
    eps = {a: "127.0.0.1:5001", b: "127.0.0.1:5002", c: "127.0.0.1:5003"}
    fwd = {(a, b): 7001, (b, c): 7002, (c, a): 7003}
    assert s.tunnel_peer_entries([a, b, c], eps, fwd) == (
        "127.0.0.1:5001=127.0.0.1:1", "127.0.0.1:5002=127.0.0.1:7001", "127.0.0.1:5003=127.0.0.1:7002")
    assert s.tunnel_peer_entries([a, b, c], eps, {(a, b): 7001}) == ()  # a pair without one: the star for all
    assert s.tunnel_peer_entries([a, c, b], eps, fwd) == ()  # (a, c) has none: order matters
    assert s.tunnel_peer_entries([a], eps, fwd) == ()


def test_only_the_worker_before_us_in_our_hosts_plan_may_send_us_a_hidden_state() -> None:
    w3 = bytes([3]) * 32
    plan = Plan(ME, (Assignment(W1, 0, 4, 1), Assignment(W2, 4, 4, 1), Assignment(w3, 8, 4, 1),
                     Assignment(ME, 12, 6, 1)), ())  # fmt: skip
    assert s.predecessor(plan, W2) == W1 and s.predecessor(plan, w3) == W2
    assert s.predecessor(plan, W1) is None and s.predecessor(plan, ME) is None and s.predecessor(plan, STRANGER) is None
    assert s.may_open_peer(W1, W2, plan, ME)
    assert not s.may_open_peer(W1, w3, plan, ME)  # not the neighbour
    assert not s.may_open_peer(ME, W1, plan, ME)  # the host is no worker's predecessor
    assert not s.may_open_peer(W2, W1, plan, ME)  # the other way round
    assert not s.may_open_peer(W1, W2, plan, HOST)  # a plan of a host we did not elect
    assert not s.may_open_peer(W1, W2, Waiting(2, 1), ME) and not s.may_open_peer(None, W2, plan, ME)


def test_peer_listeners_only_between_two_neighbours_reached_directly() -> None:
    a, b, c = (bytes([i]) * 32 for i in (1, 2, 3))
    direct = {a: "10.0.0.1:5001", b: "10.0.0.2:5001", c: "10.0.0.3:5001"}
    peer = {a: "10.0.0.1:6001", b: "10.0.0.2:6001", c: "10.0.0.3:6001"}
    assert s.peer_listeners([a, b, c], direct, peer) == (
        "10.0.0.1:5001=10.0.0.1:6001", "10.0.0.2:5001=10.0.0.2:6001", "10.0.0.3:5001=10.0.0.3:6001")
    # b through its tunnel: a and c are no neighbours, so no worker sends to another
    assert s.peer_listeners([a, b, c], {a: direct[a], c: direct[c]}, peer) == ()
    # c with no listener (a build without 0011): a -> b still goes worker to worker
    assert s.peer_listeners([a, b, c], direct, {a: peer[a], b: peer[b]}) == (
        "10.0.0.1:5001=10.0.0.1:6001", "10.0.0.2:5001=10.0.0.2:6001")
    assert s.peer_listeners([a], direct, peer) == ()  # one worker: no boundary between two


def test_peer_links_and_the_embedding_are_read_from_llama_servers_log() -> None:
    log = ("load_tensors: ...\n"
           "token embedding on [fd00::2]:5001, with layer 0\n"
           "rpc peer link 10.0.0.2:5001 -> 10.0.0.3:5001: server to server\n"
           "rpc peer link 10.0.0.3:5001 -> 10.0.0.4:5001: through this process (no link between them)\n"
           "srv  llama_server: model loaded\n")  # fmt: skip
    assert s.log_facts(log) == s.LogFacts(frozenset({"10.0.0.2:5001"}), "[fd00::2]:5001")
    assert s.log_facts("") == s.LogFacts(frozenset(), None)
    assert s.log_facts("x token embedding on 1.2.3.4:5, with layer 0\n").embedding is None  # a whole line only


def test_ram_flags_put_each_nodes_experts_in_its_own_ram_and_whole_layers_on_the_hosts_cpu() -> None:
    """The host's spilled experts in its CPU buffers; a GPU worker's in its rpc-server's CPU device (the one
    after its accelerators, named by the endpoint given to --rpc); a CPU worker's nowhere else (its one device is
    RAM); the host's whole layers in RAM as --n-gpu-layers (the units the split spreads)."""
    p = Plan(ME, (Assignment(W1, 2, 3, 1, (5, 5), (2, 3), 9, cpu_last=True), Assignment(W2, 5, 2, 1, (), (5,), 9),
                  Assignment(ME, 7, 3, 1, (), (7,), 9)), (), ram_layers=2)  # fmt: skip
    flags = s.ram_flags(p, ME, {W1: "127.0.0.1:5001", W2: "[::1]:5002"})
    assert flags == (
        "--override-tensor", r"blk\.(2|3)\.ffn_(up|down|gate)_exps=RPC2[127.0.0.1:5001]",
        "--override-tensor", r"blk\.(7)\.ffn_(up|down|gate)_exps=CPU",
    )  # fmt: skip
    assert p.n_gpu_layers == 9
    assert p.tensor_split == (2, 1, 0, 2, 4)  # W1's two GPUs and its CPU, W2, the host (+ output)
    assert s.ram_flags(replace(p, assignments=p.assignments[2:], ram_layers=0), ME, {}) == (
        "--override-tensor", r"blk\.(7)\.ffn_(up|down|gate)_exps=CPU")  # fmt: skip


def test_a_gpu_node_offering_ram_serves_its_cpu_after_its_accelerators() -> None:
    from meshllm.proto.capacity import Offer

    assert Offer(1, "cuda: x", "CUDA0,CUDA1", ram=1).served == "CUDA0,CUDA1,CPU"
    assert Offer(1, "cuda: x", "CUDA0", ram=0).served == "CUDA0"  # --max-ram 0: no CPU device
    assert Offer(1, "cpu", None, ram=5).served is None  # a CPU node: its rpc-server's default, the CPU


def test_a_request_naming_no_model_is_for_the_nodes_own_else_the_meshs_only_one() -> None:
    """This node's own model first, then the one model served; with several and none of our own: None
    (the API answers 400 listing them)."""
    from meshllm.proto.serving import default_model

    assert default_model(["a", "b"], "b") == "b"
    assert default_model(["a", "b"], "c") == "c"  # ours, though no host serves it yet: its 503 says why
    assert default_model(["a"], None) == "a"
    assert default_model(["a", "b"], None) is None
    assert default_model([], None) is None


def test_a_name_answers_as_itself_or_not_at_all() -> None:
    """A model that left is never answered by another: its name gets a 503 naming it; any name reaches the one
    model only in a mesh that has only ever served that one; an unknown name among several is a 404."""
    assert s.answer_as("x", ["x", "y"], ["x", "y"]) == "x"
    gone = s.answer_as("y", ["x"], ["x", "y"])
    assert isinstance(gone, s.Gone) and "'y' is not served now" in gone.reason and "served now: x" in gone.reason
    assert gone.retry_after_s > 0
    assert s.answer_as("gpt-4o", ["x"], ["x"]) == "x"  # one model ever: any name reaches it
    assert s.answer_as("gpt-4o", ["x"], []) == "x"
    assert s.answer_as("gpt-4o", ["x"], ["x", "y"]) is None  # two known: no stand-in for either
    assert s.answer_as("gpt-4o", ["x", "y"], ["x", "y"]) is None
    assert isinstance(s.answer_as("x", [], ["x"]), s.Gone)


def test_the_names_a_node_saw_served_are_bounded_oldest_first() -> None:
    known: dict[str, None] = {}
    s.remember(known, ["a", "b"])
    s.remember(known, [f"m{i}" for i in range(s.MAX_KNOWN_MODELS - 1)])
    assert "a" not in known and "b" in known and len(known) == s.MAX_KNOWN_MODELS
    s.remember(known, ["b"])  # seen again: the newest
    s.remember(known, ["new"])
    assert "b" in known and "m0" not in known
