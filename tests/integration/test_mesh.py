"""Real mesh-llm processes on loopback: three nodes from one token; refusals at the accepting member;
a killed member leaves every table."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from meshllm.net.conn import STREAM_AUTH, Conn
from meshllm.net.endpoint import Endpoint
from meshllm.net.meshauth import _read_frame
from meshllm.proto import admission as adm
from meshllm.proto import crypto
from meshllm.proto import token as tok
from meshllm.proto.auth import AuthChallenge, AuthHello, AuthProof, make_proof
from meshllm.proto.gossip import DEAD_AFTER_S, HEARTBEAT_S
from meshllm.proto.wire import FrameDecoder, Message, encode

from .meshlab import NodeProc, wait_for

KILL_BOUND_S = DEAD_AFTER_S + HEARTBEAT_S + 3  # silent for DEAD_AFTER_S, plus a heartbeat and a tick or two


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[NodeProc]]:
    started: list[NodeProc] = []
    yield started
    for n in started:
        n.stop()


def _membership(state: Path) -> tuple[bytes, bytes]:
    d = json.loads((state / "mesh.json").read_text())
    return bytes.fromhex(d["mesh_id"]), base64.b64decode(d["secret"])


async def _handshake_as(
    ep: Endpoint, addr: str, listener: bytes, mesh_id: bytes,
    make: Callable[[crypto.Ed25519PrivateKey, AuthChallenge], AuthProof], key: crypto.Ed25519PrivateKey,
) -> tuple[Message, AuthProof, Conn]:  # fmt: skip
    """Dial a member from ``ep`` (our ``key``), answer its challenge with ``make``: its answer, our proof, the
    connection (still open)."""
    host, port = addr.rsplit(":", 1)
    conn = await ep.dial((host, int(port)), listener)
    st = conn.open_stream(STREAM_AUTH)
    dec = FrameDecoder()
    st.write(encode(AuthHello(dialler=crypto.node_id(key), listener=listener, mesh_id=mesh_id)))
    ch = await _read_frame(st, dec, 5)
    assert isinstance(ch, AuthChallenge)
    proof = make(key, ch)
    st.write(encode(proof))
    return await _read_frame(st, dec, 5), proof, conn


async def _attempt(
    addr: str,
    listener: bytes,
    mesh_id: bytes,
    make: Callable[[crypto.Ed25519PrivateKey, AuthChallenge], AuthProof],
    key: crypto.Ed25519PrivateKey | None = None,
) -> tuple[str, AuthProof]:
    """Dial a member, answer its challenge with ``make``; return what it said and the proof we sent."""
    key = key or crypto.new_key()
    ep = Endpoint(key)
    await ep.open("127.0.0.1", 0)
    try:
        ans, proof, _ = await _handshake_as(ep, addr, listener, mesh_id, make, key)
        return type(ans).__name__ + ":" + str(getattr(ans, "reason", "")), proof
    finally:
        ep.close()


def test_three_nodes_form_a_mesh_from_one_token_and_refuse_intruders(
    nodes: list[NodeProc], tmp_path: Path, tiny_model: Path
) -> None:
    # sized so that two nodes hold the model: the host and one worker; the third stands by
    a = NodeProc(tmp_path, "a", tiny_model, "--max-vram", "0.446")
    nodes.append(a)
    wait_for(lambda: (a.state / "token").exists() and bool(a.status()), 20, "the first node's token")
    assert (a.state / "token").stat().st_mode & 0o777 == 0o600
    assert (a.state / "key").stat().st_mode & 0o777 == 0o600
    token = (a.state / "token").read_text().strip()
    assert token not in a.text(), "the token must not go to the log"
    b = NodeProc(tmp_path, "b", tiny_model, "--max-vram", "0.3", "--join", token)
    c = NodeProc(tmp_path, "c", tiny_model, "--max-vram", "0.3", env={"MESH_LLM_JOIN": token})
    nodes += [b, c]
    for n in (a, b, c):
        wait_for(lambda n=n: len(n.peers()) == 3, 30, f"{n.state.name} to see three nodes")

    # they agree on the host and on the plan
    def one_host() -> bool:
        hosts = {n.status().get("host") for n in (a, b, c)}
        return len(hosts) == 1 and None not in hosts

    wait_for(one_host, 30, "agreement on one host")
    wait_for(lambda: len({json.dumps(n.status()["plan"], sort_keys=True) for n in (a, b, c)}) == 1, 30, "one plan")
    plan = a.status()["plan"]
    assert isinstance(plan, dict) and len(plan["assignments"]) == 2 and len(plan["standby"]) == 1, plan
    assert plan["host"] == a.status()["host"]

    # ---- refusals, each decided and logged by the accepting member (a)
    addr = json.loads((a.state / "node.json").read_text())["addrs"][0]
    a_id = crypto.node_id(a.key())
    mesh_id, secret = _membership(a.state)
    good = tok.parse(token)

    async def refusals() -> dict[str, str]:
        out: dict[str, str] = {}
        tampered = replace(good, addrs=("127.0.0.1:1",))  # re-encoded without re-signing
        out["tampered"], _ = await _attempt(
            addr, a_id, mesh_id, lambda k, ch: make_proof(k, secret, ch, a_id, token=tampered)
        )
        outsider = crypto.new_key()
        alien = tok.mint(outsider, mesh_id, secret, [addr], time.time(), 3600)
        out["non-member"], _ = await _attempt(
            addr, a_id, mesh_id, lambda k, ch: make_proof(k, secret, ch, a_id, token=alien)
        )
        out["wrong-secret"], _ = await _attempt(
            addr, a_id, mesh_id, lambda k, ch: make_proof(k, os.urandom(32), ch, a_id, token=good)
        )
        joiner = crypto.new_key()
        ok, captured = await _attempt(
            addr, a_id, mesh_id, lambda k, ch: make_proof(k, secret, ch, a_id, token=good), joiner
        )
        assert ok.startswith("AuthWelcome"), ok
        out["replay"], _ = await _attempt(addr, a_id, mesh_id, lambda k, ch: captured, joiner)
        return out

    got = asyncio.run(refusals())
    # an expired token (minted by a member with a 1 s lifetime), re-encoded with a later expiry
    short_lived = subprocess.run(
        [sys.executable, "-m", "meshllm.cli", "token", "--state-dir", str(a.state), "--ttl", "1s"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    expires = tok.parse(short_lived).expires
    while time.time() <= expires:  # until it has expired
        time.sleep(0.05)
    stretched = replace(tok.parse(short_lived), expires=int(time.time() + 3600))
    got["expired+re-encoded"], _ = asyncio.run(
        _attempt(addr, a_id, mesh_id, lambda k, ch: make_proof(k, secret, ch, a_id, token=stretched))
    )
    expect = {
        "tampered": "token signature invalid",
        "non-member": "is not a member of this mesh",
        "wrong-secret": "secret proof invalid",
        "replay": "not made for this connection",
        "expired+re-encoded": "token signature invalid",
    }
    log = a.text()
    for case, words in expect.items():
        assert got[case].startswith("AuthRefuse") and words in got[case], (case, got[case])
        assert any(words in line and "refused" in line for line in log.splitlines()), f"{case}: not in a's log"
    assert token not in log and secret.hex() not in log

    # ---- kill -9 of a member: it leaves every table within the bound
    c_short = crypto.short(crypto.node_id(c.key()))
    c.stop(signal.SIGKILL)
    took = max(
        wait_for(lambda n=n: c_short not in n.peers(), KILL_BOUND_S, f"{n.state.name} to drop c") for n in (a, b)
    )
    print(f"killed node left every table after {took:.1f} s (bound {KILL_BOUND_S:.0f} s)")


def test_bad_tokens_fail_at_once_with_one_line(tmp_path: Path, tiny_model: Path) -> None:
    key = crypto.new_key()
    chain = adm.found(key, time.time())
    good = tok.mint(key, chain[0][0], os.urandom(32), ["127.0.0.1:9"], time.time(), 3600)
    cases = {
        "garbage": "hello",
        "tampered": replace(good, addrs=("10.0.0.1:1",)).encode(),
        "expired": tok.mint(key, chain[0][0], good.secret, [], time.time() - 100, 10).encode(),
    }
    for name, text in cases.items():
        state = tmp_path / name
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "meshllm.cli",
                "--model",
                str(tiny_model),
                "--state-dir",
                str(state),
                "--join",
                text,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, (name, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "invite token" in lines[0], (name, r.stderr)
        assert not state.exists(), "nothing half-started"
    # a node already in one mesh, handed a token for another
    from meshllm.machine.state import load_or_create_key, save_membership
    from meshllm.net.meshnet import new_mesh

    state = tmp_path / "member"
    save_membership(state, new_mesh(load_or_create_key(state), time.time()))
    r = subprocess.run(
        [sys.executable, "-m", "meshllm.cli", "--model", str(tiny_model), "--state-dir", str(state), "--join",
         good.encode()],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "wrong-mesh" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    # a token whose issuer does not answer fails after the node started its API: one line, and the
    # node stops what it started ("Unclosed client session" was printed after the error)
    r = subprocess.run(
        [sys.executable, "-m", "meshllm.cli", "--model", str(tiny_model), "--state-dir", str(tmp_path / "fresh"),
         "--join", good.encode()],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert r.returncode == 2 and "could not join" in r.stderr, r.stderr
    assert "Unclosed" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_joining_without_a_model_finds_it_by_fingerprint(tmp_path: Path, tiny_model: Path) -> None:
    a = NodeProc(tmp_path, "a", tiny_model, "--ctx-size", "1024")
    nodes = [a]
    try:
        wait_for(lambda: (a.state / "token").exists() and bool(a.status().get("model")), 30, "a's token")
        token = (a.state / "token").read_text().strip()
        models = tmp_path / "models"
        (models / "sub").mkdir(parents=True)
        os.link(tiny_model, models / "sub" / "my-copy-under-another-name.gguf")  # same bytes, another name
        (models / "decoy.gguf").write_bytes(b"GGUF" + bytes(100))
        empty = tmp_path / "empty"
        empty.mkdir()
        b = NodeProc(tmp_path, "b", None, "--join", token, "--models-dir", str(models), auto=True)
        c = NodeProc(tmp_path, "c", None, "--join", token, "--models-dir", str(empty), auto=True)
        nodes += [b, c]
        fp = a.status()["model"]["fingerprint"]  # type: ignore[index]

        def role_and_model(n: NodeProc) -> tuple[object, object]:
            st = n.status()
            me = next((p for p in st.get("peers", []) if p["path"] == "self"), {})  # type: ignore[attr-defined]
            return me.get("role"), me.get("model")

        wait_for(lambda: role_and_model(b) == ("worker", fp), 30, "b to serve the mesh's model")
        assert "my-copy-under-another-name.gguf" in b.text() and "joining as a worker" in b.text()
        wait_for(lambda: "staying a lite client" in c.text(), 30, "c to say why it stays a client")
        assert role_and_model(c)[0] == "client"
    finally:
        for n in nodes:
            n.stop()
