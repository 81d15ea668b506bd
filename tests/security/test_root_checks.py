"""The checks at the root of membership and of the node's secrets, each tried with the input it exists
to refuse. An audit removed them one at a time and the whole suite still passed; each test here fails when its check
is taken out (each was tried so)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from meshllm.errors import RemoteProtocolError, UserError
from meshllm.proto import admission as adm
from meshllm.proto import crypto
from meshllm.proto import signed as sgn
from meshllm.proto import token as tok
from meshllm.proto.auth import AuthChallenge, AuthHello, check_proof, make_proof
from meshllm.proto.gossip import Renewal
from meshllm.proto.meshcore import MeshCore

NOW = time.time()
FOUNDER = crypto.new_key()
CHAIN = adm.found(FOUNDER, NOW - 100)
MESH = CHAIN[0][0]


def _link(key: crypto.Ed25519PrivateKey, node: bytes, at: float, until: float, scope: tok.Scope) -> adm.Link:
    return adm._link(key, MESH, node, int(at), int(until), scope)


def test_a_chain_must_start_at_the_founder() -> None:
    """A stranger's own self-link, written for this mesh's id, is no founder's."""
    s = crypto.new_key()
    ns = crypto.node_id(s)
    fake_root = [_link(s, ns, NOW, adm.NEVER, tok.Scope.HOST)]
    assert adm.verify_chain(fake_root, ns, MESH) == "chain does not start at the mesh's founder"
    x = crypto.new_key()
    fake = [*fake_root, _link(s, crypto.node_id(x), NOW, NOW + 60, tok.Scope.HOST)]
    assert adm.verify_chain(fake, crypto.node_id(x), MESH) == "chain does not start at the mesh's founder"


def test_each_link_is_signed_by_the_member_before_it() -> None:
    """After the founder's verified link, a stranger's self-signed host-scope link (valid signature, its own)."""
    s = crypto.new_key()
    ns = crypto.node_id(s)
    forged = [*CHAIN, _link(s, ns, NOW, NOW + 60, tok.Scope.HOST)]
    assert adm.verify_chain(forged, ns, MESH) == "link 1 not signed by the previous member"
    m = crypto.new_key()
    chain_m = adm.admit(FOUNDER, CHAIN, crypto.node_id(m), NOW, tok.Scope.WORKER)
    skip = [*chain_m, _link(FOUNDER, ns, NOW, NOW + 60, tok.Scope.WORKER)]  # signed by the founder, not by m
    assert adm.verify_chain(skip, ns, MESH) == "link 2 not signed by the previous member"


def test_admin_grants_are_the_founders_only() -> None:
    m = crypto.new_key()
    g = sgn.Grant(MESH, crypto.node_id(crypto.new_key()), int(NOW), crypto.node_id(m))
    g = sgn.Grant(g.mesh_id, g.node, g.at, g.by, crypto.sign(m, crypto.D_ADMIN, g.body()))
    with pytest.raises(RemoteProtocolError, match="not made by this mesh's founder"):
        sgn.grant_from_wire(g.to_wire(), MESH)
    real = sgn.grant_admin(FOUNDER, MESH, crypto.node_id(m), NOW)
    assert sgn.grant_from_wire(real.to_wire(), MESH) == real


def test_an_admission_signed_in_the_future_is_refused() -> None:
    n = crypto.new_key()
    ahead = adm.admit(FOUNDER, CHAIN, crypto.node_id(n), NOW + 3600)
    why = adm.verify_chain(ahead, crypto.node_id(n), MESH, NOW)
    assert why == "admission signed in the future (a clock far ahead?)"
    assert adm.verify_chain(ahead, crypto.node_id(n), MESH, NOW + 3600) is None


def test_a_renewal_that_does_not_verify_widens_or_ends_sooner_is_not_adopted() -> None:
    w = crypto.new_key()
    nw = crypto.node_id(w)
    mine = adm.admit(FOUNDER, CHAIN, nw, NOW - 100, tok.Scope.WORKER, ttl_s=1000)
    core = MeshCore(key=w, mesh_id=MESH, chain=mine, incarnation=1, now=0.0, wall=NOW)
    core.tick(1.0, NOW)
    other = crypto.new_key()
    bad = [
        adm.admit(FOUNDER, CHAIN, crypto.node_id(other), NOW, tok.Scope.WORKER),  # another node's
        [*CHAIN, (*adm._link(FOUNDER, MESH, nw, int(NOW), int(NOW) + 5000, tok.Scope.WORKER)[:6], b"\0" * 64, ())],
        adm.admit(FOUNDER, CHAIN, nw, NOW, tok.Scope.HOST, ttl_s=5000),  # wider than ours
        adm.admit(FOUNDER, CHAIN, nw, NOW, tok.Scope.WORKER, ttl_s=100),  # ends sooner than ours
    ]
    for chain in bad:
        core._take_renewal(crypto.node_id(FOUNDER), Renewal(chain=adm.chain_to_wire(chain)), 2.0)  # type: ignore[arg-type]
        assert core.chain == mine, chain[-1]
    good = adm.admit(FOUNDER, CHAIN, nw, NOW, tok.Scope.WORKER, ttl_s=5000)
    core._take_renewal(crypto.node_id(FOUNDER), Renewal(chain=adm.chain_to_wire(good)), 2.0)
    assert core.chain == good


def test_a_hello_for_another_mesh_is_refused() -> None:
    secret = os.urandom(32)
    d = crypto.new_key()
    other = crypto.mesh_id_for(crypto.node_id(crypto.new_key()))
    me = crypto.node_id(FOUNDER)
    t = tok.mint(FOUNDER, MESH, secret, [], NOW, 60)
    for mesh_id, ok in ((other, False), (MESH, True)):
        hello = AuthHello(dialler=crypto.node_id(d), listener=me, mesh_id=mesh_id)
        nonce = os.urandom(32)
        proof = make_proof(d, secret, AuthChallenge(nonce), me, token=t)
        v = check_proof(key=FOUNDER, my_chain=CHAIN, mesh_id=MESH, secret=secret, hello=hello, nonce=nonce,
                        proof=proof, scope_of=lambda _: None, now=NOW)  # fmt: skip
        assert v.ok == ok, v.reason
        assert ok or v.reason.startswith("wrong mesh")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o601])
def test_secrets_readable_by_group_or_others_are_refused(tmp_path: Path, mode: int) -> None:
    from meshllm.machine import state

    state.load_or_create_key(tmp_path)
    (tmp_path / "key").chmod(mode)
    with pytest.raises(UserError, match="readable by others"):
        state.load_or_create_key(tmp_path)


def test_a_symlink_planted_at_the_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    """write_private's temporary file: another user who can guess its name plants a symlink to a file of theirs
    (or ours); the write must not follow it, and the planted target keeps its bytes."""
    from meshllm.paths import write_private

    target = tmp_path / "victim"
    target.write_text("theirs\n")
    dest = tmp_path / "s" / "token"
    dest.parent.mkdir(mode=0o700)
    planted = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    planted.symlink_to(target)
    write_private(dest, b"secret\n")
    assert target.read_text() == "theirs\n"
    assert dest.read_bytes() == b"secret\n" and not dest.is_symlink() and dest.stat().st_mode & 0o777 == 0o600
    # and had the unlink lost a race to a new plant, O_EXCL|O_NOFOLLOW refuses rather than follows
    planted.symlink_to(target)
    real_unlink = os.unlink
    try:
        os.unlink = lambda p, *a, **k: None  # type: ignore[assignment]
        with pytest.raises(UserError, match="cannot write"):
            write_private(dest, b"secret 2\n")
    finally:
        os.unlink = real_unlink
    assert target.read_text() == "theirs\n" and dest.read_bytes() == b"secret\n"


def test_a_tunnel_peer_that_ignores_flow_control_is_cut_off() -> None:
    """The far end of a tunnel writes into a loopback socket nobody reads; a peer that keeps sending past the credit
    it was granted (here 64 MiB at once) is reset and the tunnel closed — the bytes held for it stay bounded."""
    from meshllm.net.conn import STREAM_RPC
    from meshllm.net.tunnel import DATA, HDR, MAX_FRAME, WINDOW, TunnelStats, connect_and_bridge
    from tests.integration.test_endpoint import _pair

    async def main() -> None:
        a, b, accepted, addr = await _pair()
        stalled: list[asyncio.StreamWriter] = []

        async def never_read(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            stalled.append(w)
            await asyncio.sleep(60)

        sink = await asyncio.start_server(never_read, "127.0.0.1", 0)
        port = sink.sockets[0].getsockname()[1]
        try:
            conn = await a.dial(addr, b.me)
            conn.set_authenticated()
            far = await asyncio.wait_for(accepted.get(), 5)
            far.set_authenticated()  # (before any byte: a connection parks little before its proof)
            st = conn.open_stream(STREAM_RPC)
            chunk = HDR.pack(DATA, MAX_FRAME) + bytes(MAX_FRAME)
            for _ in range(64):  # never waiting for credit
                st.write(chunk)
            theirs = await asyncio.wait_for(far.accept(), 5)
            assert theirs is not None
            bridge = asyncio.ensure_future(connect_and_bridge(theirs, port, TunnelStats()))
            await asyncio.wait_for(bridge, 30)  # it ends: reset and closed, not buffering 64 MiB
            assert stalled, "the bridge never reached the sink"
        finally:
            sink.close()
            a.close()
            b.close()

    assert WINDOW < 64 * MAX_FRAME
    asyncio.run(main())
