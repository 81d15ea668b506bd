"""Admission to the mesh, the half of ``MeshNet`` that decides who is in: dialling members (every address at once, the
first that proves to be the node wins), the auth exchange as dialler (a token or our membership) and as listener
(a proof checked against the membership: ``proto/auth.py``), knocks from the LAN answered by the doorbell, and the
registration of a connection that passed. ``MeshNet`` (``net/meshnet.py``) is the rest: the endpoint, gossip, the
record, revocations and key rotation; this class only declares what it uses of it."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshllm.errors import MeshError, Refused, RemoteProtocolError
from meshllm.machine.state import (
    Membership,
    save_membership,
)
from meshllm.net.conn import STREAM_AUTH, STREAM_GOSSIP, STREAM_KNOCK, Addr, Conn, DialError, Stream
from meshllm.net.endpoint import Endpoint, parse_addr
from meshllm.net.netevents import Connected, NetEvent
from meshllm.net.traversal import Traversal
from meshllm.proto import admission as adm
from meshllm.proto import crypto, serving
from meshllm.proto import signed as sgn
from meshllm.proto import token as tok
from meshllm.proto.auth import (
    AUTH_MAX_FRAME,
    AuthChallenge,
    AuthHello,
    AuthProof,
    AuthRefuse,
    AuthWelcome,
    check_proof,
    make_proof,
    pair_token,
)
from meshllm.proto.crypto import NodeId
from meshllm.proto.knock import REFUSED, KnockAnswer, KnockAsk
from meshllm.proto.meshcore import MeshCore, Out
from meshllm.proto.wire import FrameDecoder, Message, encode
from meshllm.sockets import host_port

log = logging.getLogger("meshllm.mesh")

AUTH_TIMEOUT_S = 5.0


async def _read_frame(stream: Stream, dec: FrameDecoder, timeout: float) -> Message:
    deadline = time.monotonic() + timeout
    while True:
        msgs = dec.feed(b"")
        if msgs:
            return msgs[0]
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        data = await asyncio.wait_for(stream.read(), timeout=left)
        if not data:
            raise ConnectionError("stream closed")
        msgs = dec.feed(data)
        if msgs:
            if len(msgs) > 1:
                raise RemoteProtocolError("unexpected extra frames during auth")
            return msgs[0]


def _close_unused(f: asyncio.Future[Conn]) -> None:
    if not f.cancelled() and f.exception() is None:
        f.result().close("another member answered first")


class Admitting:
    """Mixed into ``MeshNet``, which sets these attributes and defines these methods."""

    key: Ed25519PrivateKey
    me: NodeId
    m: Membership | None
    state_dir: Path
    admit_s: float
    ep: Endpoint
    nat: Traversal
    core: MeshCore | None
    peers: dict[NodeId, Conn]
    gossip: dict[NodeId, Stream]
    refusals: list[str]
    on_knock: Callable[[KnockAsk, str], KnockAnswer] | None
    _dialling: set[NodeId]

    if TYPE_CHECKING:

        @property
        def now(self) -> float: ...

        @staticmethod
        def wall() -> float: ...

        def _make_core(self, m: Membership) -> MeshCore: ...

        def _spawn(self, coro: Awaitable[None]) -> None: ...

        def _start_gossip(self, conn: Conn, node: NodeId, st: Stream) -> None: ...

        async def _serve_streams(self, conn: Conn) -> None: ...

        async def _watch(self, conn: Conn, node: NodeId) -> None: ...

        def admitted(self) -> bool: ...

        def emit(self, ev: NetEvent) -> None: ...

        def flush_events(self) -> None: ...

        def send(self, out: Out) -> None: ...

        def set_link(self, node: NodeId, how: str) -> None: ...

    async def dial_any(self, node: NodeId, addrs: list[str], timeout: float = 3.0) -> Conn:
        """Dial every address at once (a private address of another network would cost a timeout each); the
        first that proves to be ``node`` wins."""
        errors: list[str] = []
        targets: list[Addr] = []
        for a in addrs:
            try:
                t = parse_addr(a)
            except ValueError as e:
                errors.append(str(e))
                continue
            if t not in targets:
                targets.append(t)
        tasks = [asyncio.ensure_future(self.ep.dial(t, node, timeout=timeout)) for t in targets]
        for task in tasks:  # a loser that fails after we stopped listening (shutdown) is not an unretrieved error
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        won: Conn | None = None
        try:
            for fut in asyncio.as_completed(tasks):
                try:
                    won = await fut
                    return won
                except (DialError, OSError) as e:
                    errors.append(str(e))
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
                elif not task.cancelled() and task.exception() is None and task.result() is not won:
                    task.result().close("another address answered first")
        raise DialError("; ".join(errors) or "no address")

    async def _auth_as_dialler(self, conn: Conn, node: NodeId, token: tok.Token | None) -> list[adm.Link]:
        st = conn.open_stream(STREAM_AUTH)
        dec = FrameDecoder(AUTH_MAX_FRAME)
        assert token is not None or self.m is not None
        mesh_id = token.mesh_id if token else self.m.mesh_id  # type: ignore[union-attr]
        st.write(encode(AuthHello(dialler=self.me, listener=node, mesh_id=mesh_id)))
        ch = await _read_frame(st, dec, AUTH_TIMEOUT_S)
        if not isinstance(ch, AuthChallenge):
            raise RemoteProtocolError("expected a challenge")
        if token is not None:
            proof = make_proof(self.key, token.secret, ch, node, token=token)
        else:
            assert self.m is not None
            proof = make_proof(self.key, self.m.secret, ch, node, chain=self.m.chain)
        st.write(encode(proof))
        ans = await _read_frame(st, dec, AUTH_TIMEOUT_S)
        st.close()
        if isinstance(ans, AuthRefuse):
            if ans.revocation is not None and token is None:
                self._take_refusal_revocation(ans.revocation)
            raise Refused(f"refused by {crypto.short(node)}: {ans.reason}")
        if not isinstance(ans, AuthWelcome):
            raise RemoteProtocolError("expected welcome or refusal")
        chain = adm.chain_from_wire(ans.chain)
        why = adm.verify_chain(chain, self.me, mesh_id, self.wall())
        if why is not None:
            raise RemoteProtocolError(f"welcome with an invalid admission chain: {why}")
        conn.pair_token = pair_token(ch.nonce, self.me, node)
        return chain

    def _take_refusal_revocation(self, obj: object) -> None:
        """A member refused us with the signed revocation that cuts us off (we may have missed its gossip): checked
        like any revocation, taken (so we know we are out), never trusted on the refusal's word alone."""
        if self.core is None:
            return
        table = self.core.table
        try:
            r = sgn.revocation_from_wire(obj, self.core.mesh_id, set(table.admins) - set(table.revoked))
        except RemoteProtocolError as e:
            log.warning("a refusal carried a revocation we do not take: %s", e)
            return
        self.send(self.core.revoke([r], self.now))
        self.flush_events()

    async def join(self, token: tok.Token) -> NodeId:
        """Connect to the token's issuer, or another member it names (any member checks a token), whichever answers
        first; as a joiner (token) unless we are already a member of its mesh. The member we joined through."""
        as_member = self.m is not None and self.m.mesh_id == token.mesh_id and self.admitted()
        conn, node = await self._dial_first(token.members())
        try:
            chain = await asyncio.wait_for(
                self._auth_as_dialler(conn, node, None if as_member else token), AUTH_TIMEOUT_S * 2
            )
        except BaseException:
            conn.close("auth failed")
            raise
        if not as_member:
            self.m = Membership(mesh_id=token.mesh_id, secret=token.secret, chain=chain, incarnation=1)
            save_membership(self.state_dir, self.m)
            self._make_core(self.m)
        self._register(conn, node)
        return node

    async def _dial_first(self, members: list[tuple[NodeId, list[str]]]) -> tuple[Conn, NodeId]:
        """Dial every member at once; the first that proves to be who it should be, the others closed."""
        tasks = {asyncio.ensure_future(self.dial_any(n, a)): n for n, a in members}
        errors: list[str] = []
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                won = [t for t in done if t.exception() is None]
                for t in won[1:]:  # two at once: the first is kept
                    t.result().close("another member answered first")
                if won:
                    return won[0].result(), tasks[won[0]]
                errors += [f"{crypto.short(tasks[t])}: {t.exception()}" for t in done]
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            for t in pending:  # cancelled above; one that won a race with the cancel is closed
                t.add_done_callback(_close_unused)
        raise DialError("; ".join(errors) or "no address")

    async def redial(self, members: dict[NodeId, list[str]], timeout: float) -> NodeId | None:
        """Dial the members we knew (a restart: the table is empty), all at once; the first that answered, or None
        when none did within ``timeout``."""
        tasks = [asyncio.ensure_future(self._dial_member(n, a)) for n, a in members.items()
                 if n != self.me and n not in self.peers and n not in self._dialling]  # fmt: skip
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline and not any(n in self.peers for n in members):
            if tasks and all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.05)
        return next((n for n in members if n in self.peers), None)

    def dial_members(self, members: dict[NodeId, list[str]]) -> None:
        """Dial each member we are neither connected to nor dialling already, in the background."""
        for n, a in members.items():
            if n != self.me and n not in self.peers and n not in self._dialling:
                self._spawn(self._dial_member(n, a))

    async def _dial_member(self, node: NodeId, addrs: list[str]) -> None:
        self._dialling.add(node)
        try:
            conn = await self.nat.reach(node, addrs)
            try:
                await asyncio.wait_for(self._auth_as_dialler(conn, node, None), AUTH_TIMEOUT_S * 2)
            except BaseException:
                conn.close("auth failed")
                raise
            self._register(conn, node)
        except (DialError, MeshError, TimeoutError, ConnectionError) as e:
            log.debug("dial %s failed: %s", crypto.short(node), e)
        finally:
            self._dialling.discard(node)

    async def _on_accept(self, conn: Conn) -> None:
        try:
            st = await asyncio.wait_for(conn.accept(), AUTH_TIMEOUT_S)
            if st is not None and st.kind == STREAM_KNOCK:
                await asyncio.wait_for(self._answer_knock(conn, st), AUTH_TIMEOUT_S)
                return
            if st is None or st.kind != STREAM_AUTH:
                conn.close("first stream was not auth")
                return
            await asyncio.wait_for(self._auth_as_listener(conn, st), AUTH_TIMEOUT_S * 2)
        except (TimeoutError, ConnectionError, RemoteProtocolError) as e:
            if isinstance(e, RemoteProtocolError) or str(e):
                self._refused(conn, None, f"auth did not complete: {e}")
            else:  # the other side went away mid-auth (two nodes dialling each other keep one): no refusal
                log.debug("auth from %s ended: %s", host_port(*conn.addr), type(e).__name__)
            conn.close("auth failed")
            return
        if not conn.authenticated:
            return
        self._spawn(self._serve_streams(conn))

    async def _answer_knock(self, conn: Conn, st: Stream) -> None:
        """A node with no token asks to join (``proto/knock.py``): one answer, then the connection closes;
        it never becomes authenticated. No doorbell here (not announcing): refused."""
        try:
            ask = await _read_frame(st, FrameDecoder(AUTH_MAX_FRAME), AUTH_TIMEOUT_S)
            if not isinstance(ask, KnockAsk):
                raise RemoteProtocolError("expected a knock")
            addr = host_port(*conn.addr)
            no = KnockAnswer(REFUSED, reason="this node takes no knocks")
            ans = self.on_knock(ask, addr) if self.on_knock else no
            st.write(encode(ans))
            st.close()
            await asyncio.sleep(0.05)
        finally:
            conn.close("knock answered")

    async def knock(self, node: NodeId, addrs: list[str], ask: KnockAsk) -> KnockAnswer:
        """Ask ``node`` (a member announcing its mesh on the LAN) to let us join: its answer."""
        conn = await self.dial_any(node, addrs)
        try:
            st = conn.open_stream(STREAM_KNOCK)
            st.write(encode(ask))
            ans = await _read_frame(st, FrameDecoder(AUTH_MAX_FRAME), AUTH_TIMEOUT_S)
            if not isinstance(ans, KnockAnswer):
                raise RemoteProtocolError("expected an answer to the knock")
            return ans
        finally:
            conn.close("knocked")

    def _refused(self, conn: Conn, who: NodeId | None, reason: str) -> None:
        line = f"refused {crypto.short(who) if who else '?'} from {host_port(*conn.addr)}: {reason}"
        self.refusals.append(line)
        log.warning(line)

    async def _auth_as_listener(self, conn: Conn, st: Stream) -> None:
        dec = FrameDecoder(AUTH_MAX_FRAME)
        hello = await _read_frame(st, dec, AUTH_TIMEOUT_S)
        if not isinstance(hello, AuthHello):
            raise RemoteProtocolError("expected hello")
        nonce = os.urandom(32)
        st.write(encode(AuthChallenge(nonce=nonce)))
        proof = await _read_frame(st, dec, AUTH_TIMEOUT_S)
        if not isinstance(proof, AuthProof):
            raise RemoteProtocolError("expected proof")
        if self.core is None or self.m is None:
            self._refused(conn, hello.dialler, "this node is not in a mesh yet")
            st.write(encode(AuthRefuse(reason="not in a mesh yet")))
            conn.close("refused")
            return
        v = check_proof(
            key=self.key, my_chain=self.m.chain, mesh_id=self.m.mesh_id, secret=self.m.secret, hello=hello,
            nonce=nonce, proof=proof, scope_of=self.core.table.scope_of, chain_of=self.core.table.chain_of,
            revoked=self.core.table.revoked, in_touch=bool(self.peers) or self.m.founder == self.me,
            previous=self.m.previous, now=self.wall(), admit_s=self.admit_s,
        )  # fmt: skip
        if not v.ok:
            self._refused(conn, hello.dialler, v.reason)
            word = self.core.table.revoked.get(v.revoked) if v.revoked else None
            st.write(encode(AuthRefuse(reason=v.reason, revocation=word.to_wire() if word else None)))
            await asyncio.sleep(0.05)
            conn.close("refused")
            return
        assert v.chain is not None
        conn.pair_token = pair_token(nonce, hello.dialler, self.me)
        st.write(encode(AuthWelcome(chain=adm.chain_to_wire(v.chain))))
        st.close()
        if v.joined:
            log.info("admitted %s from %s with a token", crypto.short(hello.dialler), host_port(*conn.addr))
        conn.peer = hello.dialler
        conn.set_authenticated()
        self._register(conn, hello.dialler, listener=True)

    def _register(self, conn: Conn, node: NodeId, listener: bool = False) -> None:
        old = self.peers.get(node)
        if old is not None and not old.closed.is_set():
            if serving.keep_existing(old.is_direct, conn.is_direct, old.is_client, self.me, node, conn.is_client):
                conn.close("duplicate connection")
                return
            old.close("duplicate connection")
            self.gossip.pop(node, None)  # its gossip went with it: the new connection's stream takes over
        conn.peer = node
        conn.set_authenticated()
        self.peers[node] = conn
        self.set_link(node, f"relay {crypto.short(conn.relay)}" if conn.relay else "direct")
        self.emit(Connected(node, conn.path))
        if not listener:
            st = conn.open_stream(STREAM_GOSSIP)
            self._start_gossip(conn, node, st)
            self._spawn(self._serve_streams(conn))
        self._spawn(self._watch(conn, node))
