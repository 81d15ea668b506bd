"""What a member cannot do, tried with real mesh-llm processes on loopback: take the host's seat without a host
scope, serve layers with a client scope, mint wider or longer-lived tokens than allowed, stay in after the founder
revoked it, join with a token of a rotated secret, or come back after its admission ended unrenewed."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from meshllm.machine.state import load_membership
from meshllm.proto import crypto
from meshllm.proto.admission import Link
from meshllm.proto.auth import make_proof
from meshllm.proto.layout import GB
from tests.integration.meshlab import NodeProc, _free_port, split_pair, wait_for
from tests.integration.test_mesh import _attempt, _handshake_as, _membership


def _mint(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshllm.cli", "token", "--state-dir", str(state), *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_scopes_decide_who_hosts_and_who_serves_layers(tmp_path: Path, tiny_model: Path) -> None:
    """A worker-scoped member with more memory than the host is not elected (capacity is self-reported:
    2**62 once took the mesh); a client-scoped member with a model and 2 GB serves no layers, even where the plan
    needs them; nobody mints a token wider than itself or longer-lived than 30 days."""
    a = NodeProc(tmp_path, "a", tiny_model, "--ctx-size", "1024", "--max-vram", "0.07")
    nodes = [a]
    try:
        wait_for(lambda: (a.state / "token").exists() and bool(a.status()), 30, "a's token")
        worker = _mint(a.state, "--scope", "worker")
        assert worker.returncode == 0 and "worker token" in worker.stderr, worker.stderr
        b = NodeProc(tmp_path, "b", tiny_model, "--ctx-size", "1024", "--max-vram", "0.1",
                     "--join", worker.stdout.strip())  # fmt: skip
        nodes.append(b)
        wait_for(lambda: "scope worker: this node serves layers" in b.text(), 30, "b to say its scope")
        wait_for(lambda: (b.state / "token").exists(), 30, "b's token")
        # b may invite workers and clients, not hosts, and no token lives past 30 days
        wider = _mint(b.state, "--scope", "host")
        assert wider.returncode != 0 and "worker-scoped: it can invite client, worker nodes, not host" in wider.stderr
        assert "mesh1." not in wider.stdout
        longer = _mint(a.state, "--ttl", "60d")
        assert longer.returncode != 0 and "30 days" in longer.stderr and "mesh1." not in longer.stdout
        me_a = crypto.node_id(a.key()).hex()

        def waiting() -> object:
            p = a.status().get("plan")
            return p.get("have") if isinstance(p, dict) and a.status().get("host") == me_a else None

        have = int(0.07 * GB) + int(0.1 * GB)  # a and b: not enough for the model
        wait_for(lambda: waiting() == have, 60, "a to host and wait for more memory than a and b have")
        client = _mint(b.state, "--scope", "client")
        assert client.returncode == 0, client.stderr
        c = NodeProc(tmp_path, "c", tiny_model, "--ctx-size", "1024", "--max-vram", "2",
                     "--join", client.stdout.strip())  # fmt: skip
        nodes.append(c)
        wait_for(lambda: "scope client: this node may use the API only" in c.text(), 30, "c to say its scope")
        wait_for(lambda: c.short() in a.peers(), 30, "c to be a member")
        time.sleep(4)  # past the election and plan debounces: nothing changes with c in the mesh
        for n in (a, b, c):
            assert n.status().get("host") == me_a, n.state.name
        assert waiting() == have, "c's memory went into the plan"
        scopes = {p["short"]: p["scope"] for p in a.status()["peers"]}  # type: ignore[attr-defined, index]
        assert scopes == {a.short(): "host", b.short(): "worker", c.short(): "client"}  # /mesh/status and status.json
    finally:
        for n in nodes:
            n.stop()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshllm.cli", *args], capture_output=True, text=True, timeout=60)


def test_a_revoked_member_and_those_it_admitted_are_cut_off_everywhere(tmp_path: Path, tiny_model: Path) -> None:
    """`mesh-llm revoke` on an admin's machine (the founder made it admin with `mesh-llm admin`): within
    seconds every member drops the revoked node and the node it admitted, keeps the revocation in its state dir,
    and refuses both when they dial again. Before it is admin, and against the founder, `revoke` refuses."""
    a = NodeProc(tmp_path, "a", tiny_model, "--ctx-size", "1024")
    nodes = [a]
    try:
        wait_for(lambda: (a.state / "token").exists() and bool(a.status()), 30, "a's token")
        token_a = (a.state / "token").read_text().strip()
        b = NodeProc(tmp_path, "b", None, "--join", token_a)
        d = NodeProc(tmp_path, "d", None, "--join", token_a)
        nodes += [b, d]
        wait_for(lambda: (b.state / "token").exists(), 30, "b's token")
        c = NodeProc(tmp_path, "c", None, "--join", (b.state / "token").read_text().strip())  # admitted by b
        nodes.append(c)
        wait_for(lambda: (c.state / "key").exists() and (d.state / "key").exists(), 30, "c and d to start")
        wait_for(lambda: {b.short(), c.short(), d.short()} <= a.peers() and c.short() in d.peers(), 60, "all four")
        wrong = _cli("revoke", b.short(), "--state-dir", str(d.state))
        assert wrong.returncode != 0 and "only the node that founded the mesh, or an admin" in wrong.stderr
        # the founder names d admin; d's running node hears it and keeps it: now d may revoke
        made = _cli("admin", d.short(), "--state-dir", str(a.state))
        assert made.returncode == 0 and "is an admin" in made.stdout, made.stderr
        wait_for(lambda: (d.state / "admins").exists() and crypto.node_id(d.key()).hex() in (d.state / "admins")
                 .read_text(), 15, "d to hold its grant")  # fmt: skip
        founder = _cli("revoke", a.short(), "--state-dir", str(d.state))
        assert founder.returncode != 0 and "cannot revoke the founder" in founder.stderr
        t0 = time.monotonic()
        done = _cli("revoke", b.short(), "--state-dir", str(d.state))
        assert done.returncode == 0 and f"revoked {b.short()}" in done.stdout, done.stderr
        cut = {b.short(), c.short()}
        wait_for(lambda: not (cut & (a.peers() | d.peers())), 30, "a and d to drop b and c")
        print(f"\nrevoked member and its descendant dropped everywhere {time.monotonic() - t0:.1f} s after the command")
        assert "revoked from the mesh" in a.text() and "revoked from the mesh" in d.text()
        assert crypto.node_id(b.key()).hex() in (d.state / "revoked").read_text()  # kept by a member, not only d
        # b and c learn it (from gossip, or from the signed revocation a refusal carries) and stop, rather than dial
        # and be refused for ever; c was admitted through b
        for n in (b, c):
            assert n.proc.wait(30) == 1, n.text()
            assert "no longer a member of the mesh" in n.text(), n.text()
        assert "this node was revoked" in b.text() + c.text()
        # their old chains still get them nowhere
        addr = json.loads((a.state / "node.json").read_text())["addrs"][0]
        a_id = crypto.node_id(a.key())
        mesh_id, secret = _membership(a.state)
        for n, why in ((b, "revoked from this mesh"), (c, "whom the mesh revoked")):
            held = load_membership(n.state)  # as the node itself reads it: a link naming provenance has 8 fields
            assert held is not None
            chain = held.chain

            def proof(k: crypto.Ed25519PrivateKey, ch: object, chain: list[Link] = chain) -> object:
                return make_proof(k, secret, ch, a_id, chain=chain)  # type: ignore[arg-type]

            ans, _ = asyncio.run(_attempt(addr, a_id, mesh_id, proof, key=n.key()))  # type: ignore[arg-type]
            assert ans.startswith("AuthRefuse") and why in ans, ans
        assert not (cut & (a.peers() | d.peers())), "a revoked node came back"
        assert d.short() in a.peers()
    finally:
        for n in nodes:
            n.stop()


def test_rotating_the_secret_stops_old_tokens_and_keeps_members(tmp_path: Path, tiny_model: Path) -> None:
    """`mesh-llm rotate` on the founder's machine: members get the new secret within seconds (one that was
    away gets it when it comes back), a token minted before admits nobody, a token minted after does."""
    a = NodeProc(tmp_path, "a", tiny_model, "--ctx-size", "1024")
    nodes = [a]

    def epoch(n: NodeProc) -> int:
        return int(json.loads((n.state / "mesh.json").read_text()).get("epoch", 0))

    try:
        wait_for(lambda: (a.state / "token").exists() and bool(a.status()), 30, "a's token")
        old = (a.state / "token").read_text().strip()
        b = NodeProc(tmp_path, "b", None, "--join", old)
        d = NodeProc(tmp_path, "d", None, "--join", old)
        nodes += [b, d]
        wait_for(lambda: (b.state / "key").exists() and (d.state / "key").exists(), 30, "b and d to start")
        wait_for(lambda: {b.short(), d.short()} <= a.peers(), 30, "b and d to join")
        d.stop()  # away while the secret rotates
        out = subprocess.run([sys.executable, "-m", "meshllm.cli", "rotate", "--state-dir", str(a.state)],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0 and "epoch 1" in out.stdout, out.stderr
        wait_for(lambda: epoch(a) == 1 and epoch(b) == 1, 15, "a and b to hold the new secret")
        wait_for(lambda: (a.state / "token").read_text().strip() != old, 15, "a's new invite token")
        c = NodeProc(tmp_path, "c", None, "--join", old)
        nodes.append(c)
        assert c.proc.wait(60) != 0 and "secret" in c.text(), c.text()
        new = NodeProc(tmp_path, "e", None, "--join", (a.state / "token").read_text().strip())
        nodes.append(new)
        wait_for(lambda: (new.state / "key").exists() and new.short() in a.peers(), 30, "a new token to admit")
        back = NodeProc(tmp_path, "d", None, "--join", old)  # d again, same state: its chain, the old secret
        nodes.append(back)
        wait_for(lambda: d.short() in a.peers() and epoch(back) == 1, 30, "d back in, with the new secret")
        # revoke, then rotate at once (in one tick of the founder's): the revoked node, still
        # connected for a moment, must not be handed the new secret (it was, in 1 of 2 runs)
        from meshllm.cli.main import main as cli

        wait_for(lambda: epoch(new) == 1 and new.short() in a.peers(), 30, "e a member of epoch 1")
        assert cli(["revoke", new.short(), "--state-dir", str(a.state)]) == 0
        assert cli(["rotate", "--state-dir", str(a.state)]) == 0
        assert new.proc.wait(30) == 1, new.text()
        wait_for(lambda: epoch(a) == 2 and epoch(b) == 2, 15, "a and b to hold the newer secret")
        assert epoch(new) == 1, "the revoked node got the secret rotated right after its revocation"
    finally:
        for n in nodes:
            n.stop()


def _chain_of(n: NodeProc) -> list[list[object]]:
    return json.loads((n.state / "mesh.json").read_text())["chain"]  # type: ignore[no-any-return]


def test_an_admission_is_renewed_while_in_good_standing_and_ends_for_a_node_away_too_long(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Audit finding 4: admission was for ever. The founder signs admissions of 6 s here (--admission): a
    member renews at half time and stays; stopped past its end, its chain is refused by the founder and it cannot
    start on its old membership."""
    a = NodeProc(tmp_path, "a", tiny_model, "--ctx-size", "1024", "--admission", "6s")
    nodes = [a]
    try:
        wait_for(lambda: (a.state / "token").exists() and bool(a.status()), 30, "a's token")
        b = NodeProc(tmp_path, "b", None, "--join", (a.state / "token").read_text().strip())
        nodes.append(b)
        wait_for(lambda: (b.state / "mesh.json").exists() and b.short() in a.peers(), 30, "b to join")
        first_until = int(_chain_of(b)[-1][4])  # type: ignore[call-overload]
        assert first_until - time.time() <= 7
        wait_for(lambda: int(_chain_of(b)[-1][4]) > first_until, 15, "b's admission renewed")  # type: ignore[call-overload]
        time.sleep(max(0.0, first_until + 2 - time.time()))  # past its first end: still a member
        assert b.short() in a.peers() and a.short() in b.peers()
        b_key, b_chain = b.key(), _chain_of(b)
        b.stop()
        ended = int(b_chain[-1][4])  # type: ignore[call-overload]
        time.sleep(max(0.0, ended + 1 - time.time()))
        addr = json.loads((a.state / "node.json").read_text())["addrs"][0]
        a_id = crypto.node_id(a.key())
        mesh_id, secret = _membership(a.state)
        chain = [[bytes.fromhex(str(f)) if isinstance(f, str) else f for f in link] for link in b_chain]
        ans, _ = asyncio.run(_attempt(addr, a_id, mesh_id, lambda k, ch: make_proof(k, secret, ch, a_id, chain=chain),  # type: ignore[arg-type]
                                      key=b_key))  # fmt: skip
        assert ans.startswith("AuthRefuse") and "admission expired" in ans, ans
        argv = ["--model", str(tiny_model), "--state-dir", str(b.state), "--port", str(_free_port())]
        again = subprocess.run([sys.executable, "-m", "meshllm.cli", *argv], capture_output=True, text=True, timeout=60)
        assert again.returncode == 2 and "admission to mesh" in again.stderr and "new token" in again.stderr, (
            again.stderr
        )
    finally:
        for n in nodes:
            n.stop()


def test_a_member_that_claims_to_host_reaches_no_rpc_server_and_takes_no_seat(tmp_path: Path, tiny_model: Path) -> None:
    """Audit findings 1 and 2, performed against real nodes: a worker-scoped member gossips a signed record
    that says role host, the mesh's model and 2**62 bytes of memory, then opens an RPC tunnel and asks for the
    direct-path key at the worker that serves the host's layers. Before: the record alone opened the worker's
    rpc-server (and cut the real host's tunnels), and the claimed memory won the election. Now both streams are
    reset, the host stays host, and the split still answers the same text."""
    from meshllm.net.conn import STREAM_GOSSIP, STREAM_RPC, STREAM_RPC_KEY
    from meshllm.net.endpoint import Endpoint
    from meshllm.proto import admission as adm
    from meshllm.proto import token as tok
    from meshllm.proto.auth import AuthWelcome
    from meshllm.proto.gossip import GossipPush
    from meshllm.proto.record import NodeState, PeerRecord, Role
    from meshllm.proto.wire import encode
    from meshllm.serve.fetch.modelfiles import open_model
    from tests.integration.test_serve_split import complete, text_of

    nodes: list[NodeProc] = []
    try:
        a, b = split_pair(tmp_path, tiny_model, nodes, "--rpc-path", "tunnel")
        before = text_of(complete(a.port, "/v1/completions"))
        worker = _mint(a.state, "--scope", "worker")
        assert worker.returncode == 0, worker.stderr
        token = tok.parse(worker.stdout.strip())
        b_id = crypto.node_id(b.key())
        b_addr = json.loads((b.state / "node.json").read_text())["addrs"][0]
        facts = open_model(tiny_model, None, None, True)[0].facts

        async def attack() -> tuple[bytes, bytes]:
            key = crypto.new_key()
            ep = Endpoint(key)
            await ep.open("127.0.0.1", 0)
            try:
                welcome, _, conn = await _handshake_as(
                    ep, b_addr, b_id, token.mesh_id, lambda k, ch: make_proof(k, token.secret, ch, b_id, token=token),
                    key)  # fmt: skip
                assert isinstance(welcome, AuthWelcome), welcome  # a member now, worker-scoped
                conn.peer = b_id
                conn.set_authenticated()
                chain = adm.chain_from_wire(welcome.chain)
                claim = PeerRecord(node=crypto.node_id(key), incarnation=1, seq=1, role=Role.HOST, capacity=2**62,
                                   model=facts, state=NodeState.SERVING, chain=tuple(chain))  # fmt: skip
                g = conn.open_stream(STREAM_GOSSIP)
                g.write(encode(GossipPush(records=[claim.to_wire(key)])))
                await asyncio.sleep(4)  # past the election debounce
                rpc = conn.open_stream(STREAM_RPC)
                rpc.write(bytes([14]) + (0).to_bytes(8, "little"))  # HELLO
                got_key = conn.open_stream(STREAM_RPC_KEY)
                out = []
                for s in (rpc, got_key):
                    try:
                        out.append(await asyncio.wait_for(s.read(), 10))
                    except ConnectionError:
                        out.append(b"")
                return out[0], out[1]
            finally:
                ep.close()

        rpc_reply, key_reply = asyncio.run(attack())
        assert rpc_reply == b"" and key_reply == b"", (rpc_reply, key_reply)
        wait_for(lambda: "refused an RPC tunnel from" in b.text() and "refused an RPC key to" in b.text(), 10,
                 "b to log both refusals")  # fmt: skip
        me_a = crypto.node_id(a.key()).hex()
        assert a.status().get("host") == me_a and b.status().get("host") == me_a
        assert text_of(complete(a.port, "/v1/completions")) == before
    finally:
        for n in nodes:
            n.stop()


def _raw_http(port: int, method: str, path: str, body: object) -> str:
    """Status and body of one request sent as written (no normalising of its path), as "STATUS BODY"."""
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        data = json.dumps(body).encode() if body is not None else None
        c.request(method, path, body=data, headers={"Content-Type": "text/plain"} if data else {})
        r = c.getresponse()
        return f"{r.status} {r.read().decode(errors='replace')}"
    except OSError as e:
        return f"failed: {e!r}"
    finally:
        c.close()


def _answer(port: int, within_s: float = 30) -> str:
    """A completion's text from a node's API, waiting out 503s (a host coming back after a false death)."""
    import urllib.error

    from tests.integration.test_serve_split import complete, text_of

    t_end = time.monotonic() + within_s
    while True:
        try:
            return text_of(complete(port, "/v1/completions"))
        except urllib.error.HTTPError as e:
            if e.code != 503 or time.monotonic() > t_end:
                return f"HTTP {e.code}: {e.read()[:200]!r}"
        time.sleep(0.5)


def test_a_member_that_claims_to_serve_gets_no_request_from_any_node(tmp_path: Path, tiny_model: Path) -> None:
    """1, performed against real nodes: a client-scoped member connects to the worker and to a lite client,
    gossips a signed record saying "host, serving, the mesh's model, 2**62 bytes" and a tombstone for the real
    host's current life (the host refutes it, but its new record then lands behind the claim in every table), and
    keeps its claim fresh (it is connected to the host too: a member may bury only a node it was connected to).
    Before: nodes routed to the first record in table order that said "host, serving", and
    the lite client's and the worker's requests went to the attacker. Now every node routes to the host its own
    election picks among host-scoped members: the attacker is sent no request, and every node answers the same.
    Also: the attacker's own requests to the host over the mesh reach its door, not llama-server: none of
    llama-server's own endpoints, and the host's --max-tokens holds."""
    from meshllm.net.conn import STREAM_GOSSIP, STREAM_HTTP, Conn
    from meshllm.net.endpoint import Endpoint
    from meshllm.net.tunnel import TunnelListener, TunnelStats
    from meshllm.proto import admission as adm
    from meshllm.proto import token as tok
    from meshllm.proto.auth import AuthWelcome
    from meshllm.proto.gossip import GossipPush, Tombstone
    from meshllm.proto.record import NodeState, PeerRecord, Role
    from meshllm.proto.wire import encode
    from meshllm.serve.fetch.modelfiles import open_model
    from tests.integration.test_serve_split import complete, text_of

    nodes: list[NodeProc] = []
    try:
        a, b = split_pair(tmp_path, tiny_model, nodes, "--max-tokens", "16")
        c = NodeProc(tmp_path, "c", None, "--join", (a.state / "token").read_text().strip())  # a lite client
        nodes.append(c)
        wait_for(lambda: "API up" in c.text() or "ready" in c.text(), 60, "c's API to be up")
        before = text_of(complete(a.port, "/v1/completions"))
        assert text_of(complete(c.port, "/v1/completions")) == before
        client = _mint(a.state, "--scope", "client")
        assert client.returncode == 0, client.stderr
        token = tok.parse(client.stdout.strip())
        facts = open_model(tiny_model, None, None, True)[0].facts
        a_id = crypto.node_id(a.key())
        a_life = json.loads((a.state / "mesh.json").read_text())["incarnation"]
        targets = [(crypto.node_id(n.key()), json.loads((n.state / "node.json").read_text())["addrs"][0])
                   for n in (b, c, a)]  # fmt: skip
        door: dict[str, bytes] = {}
        a_conn: list[Conn] = []
        got_http: list[int] = []
        answers: dict[str, str] = {}

        async def attack() -> None:
            key = crypto.new_key()
            me = crypto.node_id(key)
            ep = Endpoint(key)
            await ep.open("127.0.0.1", 0)
            streams, tasks = [], []
            try:
                for node, addr in targets:
                    welcome, _, conn = await _handshake_as(
                        ep, addr, node, token.mesh_id, lambda k, ch, n=node: make_proof(k, token.secret, ch, n,
                                                                                         token=token), key)  # fmt: skip
                    assert isinstance(welcome, AuthWelcome), welcome  # a member now, client-scoped
                    conn.peer = node
                    conn.set_authenticated()
                    chain = tuple(adm.chain_from_wire(welcome.chain))

                    async def serve(conn=conn) -> None:  # count every request stream sent to us
                        while (s := await conn.accept()) is not None:
                            if s.kind == STREAM_HTTP:
                                got_http.append(1)
                                s.reset()  # no answer: the node retries once, then fails (never a hang)

                    tasks.append(asyncio.ensure_future(serve()))
                    streams.append(conn.open_stream(STREAM_GOSSIP))
                    if node == a_id:
                        a_conn.append(conn)
                tomb = Tombstone(a_id, a_life, me, time.time()).signed(key).to_wire()
                t_end = time.monotonic() + 16
                seq = 0
                while time.monotonic() < t_end:
                    seq += 1
                    claim = PeerRecord(node=me, incarnation=1, seq=seq, role=Role.HOST, capacity=2**62, model=facts,
                                       state=NodeState.SERVING, chain=chain, addrs=(f"127.0.0.1:{ep.local_addr[1]}",),
                                       at=int(time.time()))  # fmt: skip
                    for s in streams:
                        s.write(encode(GossipPush(records=[claim.to_wire(key)], tombstones=[tomb] if seq == 3 else [])))
                    if seq == 6:  # past the debounces: ask every node (the host is back after its refutation)
                        for n in (a, b, c):
                            answers[n.state.name] = await asyncio.to_thread(_answer, n.port)
                    if seq == 7:  # straight to the host over the mesh, as a member's API would (a tunnel listener)
                        lst = TunnelListener(lambda: a_conn[0].open_stream(STREAM_HTTP), TunnelStats())
                        port = await lst.start()
                        big = {"prompt": "Once", "n_predict": 10**6, "ignore_eos": True}
                        for what, method, path, body in [("slots", "GET", "/slots", None),
                                                         ("props", "GET", "/v1/../props", None),
                                                         ("big", "POST", "/v1/completions", big)]:  # fmt: skip
                            door[what] = await asyncio.to_thread(_raw_http, port, method, path, body)
                        await lst.close()
                    await asyncio.sleep(1.0)
            finally:
                ep.close()

        asyncio.run(attack())
        assert got_http == [], f"the attacker was sent {len(got_http)} requests"
        assert answers == {"a": before, "b": before, "c": before}, answers
        assert door["slots"].startswith("404") and door["props"].startswith("400"), door
        assert door["big"].startswith("200") and '"completion_tokens":16' in door["big"], door["big"][-300:]
    finally:
        for n in nodes:
            n.stop()


def test_a_member_away_during_a_rotation_admits_nobody_with_its_old_secret(tmp_path: Path, tiny_model: Path) -> None:
    """A member that was away while the founder rotated the secret still held the old one and admitted
    tokens of it (its own token, re-minted at start, too) for as long as it stayed out of touch. A member connected
    to no other member (the founder aside) now admits nobody by token: it cannot know the mesh's current secret."""
    from meshllm.cli.main import main as cli

    a = NodeProc(tmp_path, "a", tiny_model, "--ctx-size", "1024")
    nodes = [a]
    try:
        wait_for(lambda: (a.state / "token").exists() and bool(a.status()), 30, "a's token")
        b = NodeProc(tmp_path, "b", None, "--join", (a.state / "token").read_text().strip())
        nodes.append(b)
        wait_for(lambda: (b.state / "key").exists() and b.short() in a.peers(), 30, "b to join")
        b.stop()
        assert cli(["rotate", "--state-dir", str(a.state)]) == 0
        wait_for(lambda: json.loads((a.state / "mesh.json").read_text()).get("epoch") == 1, 15, "a's new secret")
        a.stop()
        (b.state / "token").unlink()
        b2 = NodeProc(tmp_path, "b", tiny_model, "--ctx-size", "1024")  # back, alone, with the old secret
        nodes.append(b2)
        wait_for(lambda: (b.state / "token").exists(), 30, "b's token, minted at start")
        assert json.loads((b.state / "mesh.json").read_text()).get("epoch", 0) == 0
        c = NodeProc(tmp_path, "c", None, "--join", (b.state / "token").read_text().strip())
        nodes.append(c)
        assert c.proc.wait(60) != 0, c.text()
        assert "connected to no other member" in c.text() + b2.text(), c.text()
    finally:
        for n in nodes:
            n.stop()


def test_a_member_holds_no_more_than_its_share_of_the_hosts_door(tmp_path: Path, tiny_model: Path) -> None:
    """The host's door (where peers' requests enter) had no per-peer bound. A client-scoped member opens
    70 request streams to the host, each with half a request head: 64 are bridged to the door (its share), the rest
    are reset at once; keys it minted for itself would count as it (``adm.accountable``: unit-tested)."""
    from meshllm.net.conn import STREAM_HTTP
    from meshllm.net.endpoint import Endpoint
    from meshllm.net.tunnel import TunnelListener, TunnelStats
    from meshllm.proto import token as tok
    from meshllm.proto.auth import AuthWelcome
    from meshllm.serve.split.door import DOOR_PER_MEMBER

    a = NodeProc(tmp_path, "a", tiny_model, "--ctx-size", "1024")
    try:
        wait_for(lambda: "ready:" in a.text(), 120, "a to serve")
        client = _mint(a.state, "--scope", "client")
        assert client.returncode == 0, client.stderr
        token = tok.parse(client.stdout.strip())
        a_id = crypto.node_id(a.key())
        addr = json.loads((a.state / "node.json").read_text())["addrs"][0]

        async def attack() -> tuple[int, int]:
            key = crypto.new_key()
            ep = Endpoint(key)
            await ep.open("127.0.0.1", 0)
            try:
                welcome, _, conn = await _handshake_as(
                    ep, addr, a_id, token.mesh_id,
                    lambda k, ch: make_proof(k, token.secret, ch, a_id, token=token), key)  # fmt: skip
                assert isinstance(welcome, AuthWelcome), welcome
                conn.peer = a_id
                conn.set_authenticated()
                # requests as a member's API sends them: each over its own tunnel (TunnelListener frames the bytes)
                lst = TunnelListener(lambda: conn.open_stream(STREAM_HTTP), TunnelStats())
                port = await lst.start()
                socks = []
                for _ in range(DOOR_PER_MEMBER + 6):
                    r, w = await asyncio.open_connection("127.0.0.1", port)
                    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                    socks.append((r, w))
                    await asyncio.sleep(0.01)
                await asyncio.sleep(1.0)

                async def ended(r: asyncio.StreamReader) -> bool:
                    try:
                        return await asyncio.wait_for(r.read(), 0.5) == b""
                    except (TimeoutError, ConnectionError):
                        return False

                gone = sum(await asyncio.gather(*(ended(r) for r, _ in socks)))
                for _, w in socks:
                    w.close()
                await lst.close()
                return len(socks) - gone, gone
            finally:
                ep.close()

        held, reset = asyncio.run(attack())
        print(f"\n{held} of the member's request streams held at the host's door, {reset} reset")
        assert (held, reset) == (DOOR_PER_MEMBER, 6)
    finally:
        a.stop()
