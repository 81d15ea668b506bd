"""The NAT lab's cells: two members behind NATs (or one public) connect directly when the network allows,
through a relay when it does not; and a real split completion crosses both kinds of path.

Every cell: a rendezvous node founds the mesh on the public segment (it relays, being publicly reachable); A and
B join with its token, then must connect to each other. The time printed is from B's start to the A–B
connection being up on both sides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshllm.paths import write_private
from meshllm.proto import crypto
from meshllm.proto import token as tok

from .lab import RDV, Lab, why_not

REASON = why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
PROMPT = "The lighthouse keeper counted the gulls on the northern rocks"


@pytest.fixture
def lab() -> Iterator[Lab]:
    lb = Lab()
    try:
        yield lb
    finally:
        lb.down()


class Node:
    def __init__(
        self, lab: Lab, where: str, tmp: Path, name: str, *args: str, env: dict[str, str] | None = None,
        port: int = 9337,
    ) -> None:  # fmt: skip
        self.name, self.lab, self.where = name, lab, where
        self.state = tmp / name
        self.log = tmp / f"{name}.log"
        argv = [sys.executable, "-m", "meshllm.cli", *args, "--state-dir", str(self.state), "--port", str(port)]
        self.proc = subprocess.Popen(lab.exec_argv(where, argv), stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)  # fmt: skip

    def status(self) -> dict[str, object]:
        try:
            return dict(json.loads((self.state / "status.json").read_text()))
        except (OSError, ValueError):
            return {}

    def peer(self, node: str) -> dict[str, object] | None:
        for p in self.status().get("peers", []):  # type: ignore[attr-defined]
            if p["node"] == node:
                return dict(p)
        return None

    @property
    def id(self) -> str:
        return str(self.status().get("node", ""))

    def tail(self) -> str:
        return f"--- {self.name} ---\n" + self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def wait(cond: object, timeout: float, what: str, nodes: list[Node]) -> float:
    t0 = time.monotonic()
    while not cond():  # type: ignore[operator]
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(n.tail() for n in nodes))
        time.sleep(0.1)
    return time.monotonic() - t0


def start_mesh(lab: Lab, tmp: Path, model: Path, mode_a: str, mode_b: str, stagger: float,
               a_args: tuple[str, ...], b_args: tuple[str, ...], env: dict[str, str] | None = None,
               ) -> tuple[Node, Node, Node, float]:  # fmt: skip
    """rdv founds the mesh; A (in natA itself when 'public') and B join with its token ('same': B on A's LAN, behind
    natA too; '+v6': both homes have routed IPv6 besides, behind a stateful firewall)."""
    v6 = mode_a.endswith("+v6")
    mode_a, mode_b = mode_a.removesuffix("+v6"), mode_b.removesuffix("+v6")
    lab.up("cone" if mode_a == "public" else mode_a, "cone" if mode_b == "same" else mode_b, mode_b == "same", v6)
    rdv = Node(lab, "rdv", tmp, "rdv", "--model", str(model), "--max-vram", "0.01", "--bind-host", RDV,
               "--bind-port", "7000")  # fmt: skip
    nodes = [rdv]
    wait(lambda: (rdv.state / "token").exists(), 30, "rdv's token", nodes)
    token = (rdv.state / "token").read_text().strip()
    a = Node(lab, "natA" if mode_a == "public" else "homeA", tmp, "a", "--model", str(model), *a_args, "--join", token,
             env=env)  # fmt: skip
    time.sleep(stagger)
    t_b = time.monotonic()
    b = Node(lab, "homeA2" if mode_b == "same" else "homeB", tmp, "b", "--model", str(model), *b_args, "--join",
             token, env=env)  # fmt: skip
    return rdv, a, b, t_b


def connected(x: Node, y: Node) -> bool:
    p = x.peer(y.id) if y.id else None
    return p is not None and str(p["path"]).startswith(("direct", "relayed"))


CELLS = [
    # A, B, seconds between their starts, RTT A and B add to every link (user-space delay: MESH_LLM_NETEM),
    # acceptable paths
    ("public", "cone", 0.0, 0, {"direct"}),
    ("cone", "cone", 0.5, 0, {"direct"}),
    ("cone", "cone", 0.5, 60, {"direct"}),  # the punch request takes 30+ ms to arrive: TTL 2 keeps it safe
    ("cone+fw", "cone+fw", 0.0, 0, {"direct"}),
    # A's NAT picks a new port per destination, B's lets in only what B sent to: no punched path can exist
    ("random", "cone", 0.0, 0, {"relayed"}),
    ("random", "random", 0.0, 0, {"relayed"}),
    ("blocked", "cone", 0.0, 0, {"relayed"}),
    # A and B on one LAN behind one NAT (one public address): straight over the LAN
    ("cone", "same", 0.0, 0, {"direct"}),
    # the same NATs as random/random, and IPv6 routed to both homes behind stateful firewalls: punched
    # over IPv6, no relay
    ("random+v6", "random+v6", 0.0, 0, {"direct"}),
]


@pytest.mark.parametrize(("mode_a", "mode_b", "stagger", "rtt", "paths"), CELLS,
                         ids=[f"{c[0]}-{c[1]}" + (f"-{c[3]}ms" if c[3] else "") for c in CELLS])  # fmt: skip
def test_cell(
    lab: Lab, tmp_path: Path, tiny_model: Path, mode_a: str, mode_b: str, stagger: float, rtt: int, paths: set[str]
) -> None:
    low = ("--max-vram", "0.01")  # too little memory to serve: these nodes only connect
    env = {"MESH_LLM_NETEM": f"rtt={rtt}"} if rtt else None
    nodes: list[Node] = []
    try:
        rdv, a, b, t_b = start_mesh(lab, tmp_path, tiny_model, mode_a, mode_b, stagger, low, low, env)
        nodes = [rdv, a, b]
        wait(lambda: connected(a, b) and connected(b, a), 60, f"A and B to connect ({mode_a}/{mode_b})", nodes)
        ttfb = time.monotonic() - t_b
        pa, pb = a.peer(b.id), b.peer(a.id)
        assert pa is not None and pb is not None
        kind = str(pa["path"]).split()[0]
        assert kind in paths, (pa, pb)
        assert str(pb["path"]).split()[0] == kind, (pa, pb)
        # whoever dialled pinned the other's TLS key; the listener holds the other's auth proof: never the relay's
        assert pa["pinned_key"] == b.id and pb["pinned_key"] == a.id, (pa, pb)
        if kind == "relayed":
            assert str(pa["path"]).endswith(rdv.id[:8]), pa
        if mode_b == "same":  # over their LAN addresses: never the relay, never the shared public address
            assert str(pa["path"]).startswith("direct 192.168.1.3:") and str(pb["path"]).startswith(
                "direct 192.168.1.2:"), (pa, pb)
            assert int(rdv.status()["reach"]["relayed_bytes"]) == 0  # type: ignore[index]
            shown = subprocess.run([sys.executable, "-m", "meshllm.cli", "status", "--state-dir", str(a.state)],
                                   capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "200"})
            assert f"direct {str(pa['path']).split()[1]}" in shown.stdout, shown.stdout + shown.stderr
        if mode_a.endswith("+v6"):
            assert str(pa["path"]).startswith("direct [2001:db8:b::2]:"), pa
            assert str(pb["path"]).startswith("direct [2001:db8:a::2]:"), pb
            assert int(rdv.status()["reach"]["relayed_bytes"]) == 0  # type: ignore[index]
        if mode_a != "public":
            # A learned its public address from a member; it leads A's addresses and A's tokens carry it
            addrs = a.status()["reach"]["addrs"]  # type: ignore[index]
            assert str(addrs[0]).startswith("198.51.100.2:"), addrs
            assert tok.parse((a.state / "token").read_text().strip()).addrs[0] == addrs[0]
            seen = rdv.peer(a.id)
            assert seen is not None and str(seen["path"]).startswith("direct 198.51.100.2:"), seen
        cell = f"{mode_a}/{mode_b}" + (f" +{rtt} ms RTT" if rtt else "")
        print(f"\nNAT cell {cell}: {pa['path']} (A) / {pb['path']} (B), connected {ttfb:.1f} s after B started")
    finally:
        for n in nodes:
            n.stop()


def _complete(lab: Lab, where: str, prompt: str) -> str:
    """Ask the node's :9337 in its own namespace (it forwards to the host through the mesh)."""
    body = json.dumps({"prompt": prompt, "max_tokens": 16, "temperature": 0, "seed": 1, "cache_prompt": False})
    code = (
        "import sys,urllib.request\n"
        "r=urllib.request.Request('http://127.0.0.1:9337/v1/completions',data=sys.argv[1].encode(),"
        "headers={'Content-Type':'application/json'})\n"
        "print(urllib.request.urlopen(r,timeout=120).read().decode())"
    )
    for _ in range(30):  # a node learns that the host serves from gossip, a moment after the host does
        out = subprocess.run(lab.exec_argv(where, [sys.executable, "-c", code, body]), capture_output=True, text=True,
                             timeout=180)  # fmt: skip
        if "503" not in out.stderr:
            break
        time.sleep(1)
    assert out.returncode == 0, out.stderr[-2000:]
    return str(json.loads(out.stdout)["choices"][0]["text"])


@pytest.mark.parametrize(("mode_a", "mode_b", "path"), [("random", "random", "relayed"), ("cone", "cone", "direct"),
                                                        ("random+v6", "random+v6", "direct [2001:db8:b::2]")])
def test_split_completion_across_nats(
    lab: Lab, tmp_path: Path, tiny_model: Path, mode_a: str, mode_b: str, path: str
) -> None:
    """Host behind natA, worker behind natB, a real completion asked at the worker (so the prompt crosses the
    A–B path); on the relayed path the relay's wire never shows the prompt."""
    nodes: list[Node] = []
    capture = tmp_path / "rdv.pcap.raw"
    cap: subprocess.Popen[bytes] | None = None
    try:
        rdv, a, b, _ = start_mesh(lab, tmp_path, tiny_model, mode_a, mode_b, 0.0,
                                  ("--max-vram", "0.446", "--ctx-size", "1024"),
                                  ("--max-vram", "0.3", "--ctx-size", "1024"))  # fmt: skip
        nodes = [rdv, a, b]
        wait(lambda: connected(a, b) and connected(b, a), 60, "A and B to connect", nodes)

        def serving() -> bool:
            plan = a.status().get("plan")
            asg = plan.get("assignments", []) if isinstance(plan, dict) else []
            return a.status().get("state") == "serving" and any(x["node"] == b.id and x["count"] for x in asg)

        wait(serving, 120, "the host to serve a split with B", nodes)
        assert str(a.peer(b.id)["path"]).startswith(path)  # type: ignore[index]
        # B's TCP port is behind its NAT (IPv4) or its router's firewall (IPv6): the split takes the QUIC tunnel
        # (", with the token embedding" follows where B holds it: patch 0013, once llama-server has logged it)
        assert str(a.peer(b.id)["rpc_path"]).split(",")[0].split()[0] == "tunnel", a.peer(b.id)  # type: ignore[index]
        cap = subprocess.Popen(lab.exec_argv("rdv", [sys.executable, str(Path(__file__).parent / "capture.py"),
                                                      "eth0", str(capture)]))  # fmt: skip
        time.sleep(0.5)
        relayed_before = int(rdv.status()["reach"]["relayed_packets"])  # type: ignore[index]
        via_b = _complete(lab, "homeB", PROMPT)
        via_a = _complete(lab, "homeA", PROMPT)
        assert via_b == via_a and via_b.strip(), (via_a, via_b)
        cap.terminate()
        cap.wait(10)
        relayed = int(rdv.status()["reach"]["relayed_packets"]) - relayed_before  # type: ignore[index]
        wire = capture.read_bytes()
        print(f"\n{mode_a}/{mode_b}: completion through {a.peer(b.id)['path']}; relay forwarded {relayed} packets; "  # type: ignore[index]
              f"{len(wire)} bytes captured at the relay")  # fmt: skip
        if path == "relayed":
            assert relayed > 0 and len(wire) > 10_000, (relayed, len(wire))
            assert PROMPT.encode() not in wire and b"lighthouse keeper" not in wire
            pa, pb = a.peer(b.id), b.peer(a.id)
            assert pa and pb and pa["pinned_key"] == b.id and pb["pinned_key"] == a.id, (pa, pb)
            assert rdv.id not in (pa["pinned_key"], pb["pinned_key"])
            # the relay says what it forwards and its cap per pair (nothing of this split went over it)
            shown = subprocess.run([sys.executable, "-m", "meshllm.cli", "status", "--state-dir", str(rdv.state)],
                                   capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "200"})
            assert "relaying for members: 2 pairs lately" in shown.stdout, shown.stdout + shown.stderr
            assert "at most 8 MB/s per pair (0 packets over it dropped)" in shown.stdout, shown.stdout
        else:
            assert relayed == 0, relayed
    finally:
        if cap is not None and cap.poll() is None:
            cap.kill()
        for n in nodes:
            n.stop()


def test_a_relayed_split_moves_to_a_punched_path_without_a_reload(lab: Lab, tmp_path: Path, tiny_model: Path) -> None:
    """A starts where UDP may only reach the relay, so A and B meet through it and serve a split that way; then
    the network opens up: the relayed connection moves onto a punched direct path under the running split (the
    same QUIC connection: no reconnect, no re-plan, no llama-server restart)."""
    nodes: list[Node] = []
    try:
        rdv, a, b, _ = start_mesh(lab, tmp_path, tiny_model, "blocked", "cone", 0.0,
                                  ("--max-vram", "0.446", "--ctx-size", "1024"),
                                  ("--max-vram", "0.3", "--ctx-size", "1024"))  # fmt: skip
        nodes = [rdv, a, b]
        wait(lambda: connected(a, b) and connected(b, a), 60, "A and B to connect", nodes)
        assert str(a.peer(b.id)["path"]).startswith("relayed"), a.peer(b.id)  # type: ignore[index]
        wait(lambda: a.status().get("state") == "serving", 120, "the host to serve", nodes)
        before = _complete(lab, "homeB", PROMPT)
        starts = a.status()["llama_starts"]
        lab.unblock("natA")
        t0 = time.monotonic()
        wait(lambda: all(str((x.peer(y.id) or {}).get("path", "")).startswith("direct") for x, y in ((a, b), (b, a))),
             100, "the relayed connection to go direct", nodes)  # fmt: skip
        print(f"\nblocked→cone: {a.peer(b.id)['path']} {time.monotonic() - t0:.1f} s after the network opened")  # type: ignore[index]
        relayed = int(rdv.status()["reach"]["relayed_packets"])  # type: ignore[index]
        assert _complete(lab, "homeB", PROMPT) == before
        assert a.status()["llama_starts"] == starts
        assert int(rdv.status()["reach"]["relayed_packets"]) - relayed < 10  # type: ignore[index]
        for x in (a, b):
            assert "died" not in x.log.read_text() and "went silent" not in x.log.read_text()
    finally:
        for n in nodes:
            n.stop()


def test_members_find_each_other_again_after_a_nat_reboot(lab: Lab, tmp_path: Path, tiny_model: Path) -> None:
    """natA forgets every mapping (a router reboot): A's packets leave from new ports, and packets from peers that
    arrive first are dropped. A must end up connected to the rendezvous and to B again."""
    low = ("--max-vram", "0.01")
    # keys chosen so that the public rendezvous is the designated dialler towards A: it cannot dial into natA, and
    # once A has lost every connection nobody is left to coordinate a punch, so A itself must dial
    keys = sorted((crypto.new_key() for _ in range(3)), key=crypto.node_id)
    for name, key in zip(("rdv", "a", "b"), keys, strict=True):
        write_private(tmp_path / name / "key", crypto.key_to_bytes(key))
    nodes: list[Node] = []
    try:
        rdv, a, b, _ = start_mesh(lab, tmp_path, tiny_model, "cone", "cone", 0.0, low, low)
        nodes = [rdv, a, b]
        wait(lambda: connected(a, b) and connected(b, a) and connected(a, rdv), 60, "the mesh to connect", nodes)
        assert rdv.id < a.id < b.id
        # A's packets are held back while natA forgets, so the peers' packets arrive first and take A's old
        # public port: when A's packets flow again they leave from a new one (the case that strands a node)
        hold = ["iptables", "FORWARD", "-i", "lan", "-p", "udp", "-j", "DROP"]
        lab.n("natA", *hold[:1], "-I", *hold[1:])
        subprocess.run(lab.exec_argv("natA", ["conntrack", "-F"]), capture_output=True, check=True)
        time.sleep(4)
        lab.n("natA", *hold[:1], "-D", *hold[1:])
        t0 = time.monotonic()
        time.sleep(1)
        every = [(x, y) for x in nodes for y in nodes if x is not y]
        wait(lambda: all(connected(x, y) for x, y in every), 90, "everyone to be connected again", nodes)
        print(f"\nNAT reboot: every pair connected again {time.monotonic() - t0:.1f} s after natA forgot its "
              f"mappings (A–B {a.peer(b.id)['path']})")  # type: ignore[index]  # fmt: skip
        assert (a.peer(b.id) or {}).get("path") not in (None, "not connected")
    finally:
        for n in nodes:
            n.stop()


def _approve_or_refuse(a: Node, cmd: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshllm.cli", cmd, *args, "--state-dir", str(a.state)],
                          capture_output=True, text=True, timeout=30)  # fmt: skip


def _approve(a: Node, *args: str) -> subprocess.CompletedProcess[str]:
    return _approve_or_refuse(a, "approve", *args)


def test_a_mesh_found_on_the_lan_is_joined_only_with_approval(lab: Lab, tmp_path: Path, tiny_model: Path) -> None:
    """A founds a mesh in homeA with memory for half of the model and announces it on its LAN (mDNS); B on
    the same LAN (homeA2) finds it with --join-lan and knocks, and so does S (a stranger, also on that LAN), and C
    behind the other NAT (mDNS stays on its LAN: C finds nothing and says so). Approved, B joins and the split
    serves; S, never approved, is in nothing."""
    lab.up("cone", "cone", True)
    half = ("--model", str(tiny_model), "--max-vram", "0.446", "--ctx-size", "1024")
    nodes: list[Node] = []
    try:
        a = Node(lab, "homeA", tmp_path, "a", *half, "--name", "desk-a")
        nodes.append(a)
        wait(lambda: "waiting for more peers" in a.log.read_text(), 30, "A to wait for memory", nodes)
        # a neighbour on the same LAN (the NAT box's LAN side, 192.168.1.1) announces A's mesh under its
        # own key and relays every knock it gets to A, to replay one once A approves
        loot = tmp_path / "neighbour.json"
        a_addrs = json.loads((a.state / "node.json").read_text())["addrs"]
        mesh_id = crypto.mesh_id_for(bytes.fromhex(a.id))
        relay = subprocess.Popen(lab.exec_argv("natA", [
            sys.executable, "-m", "tests.security.neighbour", "--mesh", mesh_id.hex(), "--founder", a.id,
            *(w for x in a_addrs for w in ("--founder-addr", x)), "--bind", "192.168.1.1", "--out", str(loot)]),
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        wait(lambda: loot.exists(), 30, "the neighbour to announce", nodes)
        b = Node(lab, "homeA2", tmp_path, "b", *half, "--join-lan", "--name", "laptop-b")
        s = Node(lab, "homeA2", tmp_path, "s", "--client", "--join-lan", "--name", "stranger", port=9338)
        c = Node(lab, "homeB", tmp_path, "c", "--client", "--join-lan", "--name", "far-c")
        nodes += [b, s, c]
        for n in (b, s):
            wait(lambda n=n: "asked to join mesh" in n.log.read_text(), 30, f"{n.name}'s knock", nodes)  # type: ignore[misc]
        listed = _approve(a).stdout
        assert "laptop-b" in listed and "stranger" in listed and "far-c" not in listed, listed
        assert "192.168.1.3:" in listed  # the knocks came over the LAN
        assert listed.count("laptop-b") == 1 and "192.168.1.1:" not in listed  # nothing listed from the relay
        b_id = next(line.split()[0] for line in listed.splitlines() if "laptop-b" in line)
        t0 = time.monotonic()
        assert _approve(a, b_id).returncode == 0
        wait(lambda: "ready:" in a.log.read_text(), 30, "the split over A and B to serve", nodes)
        time.sleep(4)  # two more rounds of the neighbour's relays after the approval
        relay.terminate()
        relay.wait(10)
        relayed = json.loads(loot.read_text())["relayed"]
        assert relayed and all(st == "refused" and "addressed to another node" in why and not token
                               for st, why, token in relayed), relayed  # fmt: skip
        assert b.peer(a.id) is not None and str(b.peer(a.id)["path"]).startswith("direct 192.168.1.2:")  # type: ignore[index]
        assert len(a.status()["plan"]["assignments"]) == 2  # type: ignore[index, arg-type]
        print(f"\nLAN discovery: approved -> the split over A and B serving in {time.monotonic() - t0:.1f} s")
        wait(lambda: c.proc.poll() is not None, 40, "C to give up", nodes)
        assert c.proc.returncode != 0 and "no mesh announces itself on this LAN" in c.log.read_text(), c.tail()
        assert "joined mesh" not in s.log.read_text() and s.id not in {p["node"] for p in a.status()["peers"]}  # type: ignore[attr-defined]
        assert "stranger" in _approve(a).stdout  # still waiting: nobody approved it
        s_id = next(line.split()[0] for line in _approve(a).stdout.splitlines() if "stranger" in line)
        assert _approve_or_refuse(a, "refuse", s_id).returncode == 0
        wait(lambda: s.proc.poll() is not None, 10, "S to stop", nodes)
        assert s.proc.returncode != 0 and "refused this node" in s.log.read_text(), s.tail()
    finally:
        for n in nodes:
            n.stop()


def test_a_split_over_three_lan_machines_sends_activations_worker_to_worker(
    lab: Lab, tmp_path: Path, tiny_model: Path
) -> None:
    """With real addresses: host A (homeA, 192.168.1.2) and workers B (homeA2, .3) and C (natA, .1) on
    one LAN. A's llama-server links its two workers; the second takes the key only from the first's address. A, a
    member that is not that worker, is refused at the second's peer listener even with TLS 1.3 and a key of its
    own; the split answers throughout."""
    lab.up("cone", "cone", True)
    nodes: list[Node] = []
    try:
        a = Node(lab, "homeA", tmp_path, "a", "--model", str(tiny_model), "--max-vram", "0.446", "--ctx-size", "1024")
        nodes.append(a)
        wait(lambda: (a.state / "token").exists(), 30, "A's token", nodes)
        token = (a.state / "token").read_text().strip()
        for where, name in (("homeA2", "b"), ("natA", "c")):
            nodes.append(Node(lab, where, tmp_path, name, "--model", str(tiny_model), "--max-vram", "0.07",
                              "--ctx-size", "1024", "--join", token))  # fmt: skip
        wait(lambda: "ready:" in a.log.read_text() and len(a.status().get("plan", {}).get("assignments", [])) == 3,  # type: ignore[attr-defined]
             180, "a 3-way split", nodes)  # fmt: skip
        assert _complete(lab, "homeA", PROMPT).strip()
        said = (a.state / "llama-server.log").read_text()
        assert ": server to server" in said, said[-3000:]
        logs = {n.name: (n.state / "rpc-server.log").read_text() for n in nodes[1:]}
        second = next(n for n in nodes[1:] if "the host allows a predecessor at" in logs[n.name])
        first = next(n for n in nodes[1:] if n is not second)
        first_ip = {"b": "192.168.1.3", "c": "192.168.1.1"}[first.name]
        second_ip = {"b": "192.168.1.3", "c": "192.168.1.1"}[second.name]
        assert f"the host allows a predecessor at {first_ip}" in logs[second.name]
        assert f"peer link to {second_ip}:" in logs[first.name] and "connected" in logs[first.name]
        port = next(line.split(":")[-1].split()[0] for line in logs[second.name].splitlines()
                    if "peer endpoint" in line)  # fmt: skip
        # A (a member, the host even) at the second worker's peer listener: refused before any handshake
        tried = subprocess.run(
            lab.exec_argv("homeA", ["openssl", "s_client", "-connect", f"{second_ip}:{port}", "-tls1_3",
                                    "-ciphersuites", "TLS_AES_128_GCM_SHA256", "-psk_identity", "peer-x",
                                    "-psk", "11" * 32]),
            input=b"", capture_output=True, timeout=30,
        )  # fmt: skip
        assert b"Cipher is TLS_AES_128_GCM_SHA256" not in tried.stdout, tried.stdout[-2000:]
        wait(lambda: "peer link refused: no key for its address 192.168.1.2"
             in (second.state / "rpc-server.log").read_text(), 10, "the refusal", nodes)  # fmt: skip
        assert _complete(lab, "homeA", PROMPT).strip()
    finally:
        for n in nodes:
            n.stop()


def test_a_split_over_an_ipv6_only_link_connects_and_serves_directly(
    lab: Lab, tmp_path: Path, tiny_model: Path
) -> None:
    """A (fd00:6::1), B (::2) and C (::3) share a link with no IPv4 on it. A's token names its IPv6
    address; B and C join with it over QUIC on IPv6; A's llama-server reaches both rpc-servers over TCP + TLS on
    IPv6 and links them worker to worker (patch 0012 on 0005 and 0011): the split answers at every node, and the
    key rows name the host and the predecessor by their IPv6 addresses."""
    lab.up_v6()
    nodes: list[Node] = []
    try:
        a = Node(lab, "v6a", tmp_path, "a", "--model", str(tiny_model), "--max-vram", "0.446", "--ctx-size", "1024")
        nodes.append(a)
        wait(lambda: (a.state / "token").exists(), 30, "A's token", nodes)
        token = (a.state / "token").read_text().strip()
        named = tok.parse(token).addrs
        assert any(x.startswith("[fd00:6::1]:") for x in named), named
        t0 = time.monotonic()
        b, c = (Node(lab, where, tmp_path, name, "--model", str(tiny_model), "--max-vram", "0.07", "--ctx-size",
                     "1024", "--join", token) for where, name in (("v6b", "b"), ("v6c", "c")))  # fmt: skip
        nodes += [b, c]
        wait(lambda: all(connected(x, y) for x, y in ((a, b), (b, a), (a, c))), 30, "B and C to connect", nodes)
        took = time.monotonic() - t0
        ip = {"a": "fd00:6::1", "b": "fd00:6::2", "c": "fd00:6::3"}
        for x, y in ((a, b), (b, a), (a, c)):
            assert str(x.peer(y.id)["path"]).startswith(f"direct [{ip[y.name]}]:"), x.peer(y.id)  # type: ignore[index]

        def direct_split() -> bool:
            rpc = {w.name: str((a.peer(w.id) or {}).get("rpc_path") or "") for w in (b, c)}
            return "ready:" in a.log.read_text() and all(
                r.startswith(f"direct [{ip[n]}]:") and "(TLS)" in r for n, r in rpc.items())

        wait(direct_split, 180, "a 3-way split over the direct RPC path on IPv6", nodes)
        answers = {_complete(lab, where, PROMPT) for where in ("v6a", "v6b", "v6c")}
        assert len(answers) == 1 and answers.pop().strip(), answers
        assert ": server to server" in (a.state / "llama-server.log").read_text()
        said = a.log.read_text()  # addresses in brackets are not taken for the terminal's markup
        assert "listening on UDP [fd00:6::1]:" in said and f"connected to {b.id[:8]}: direct [fd00:6::2]:" in said
        shown = subprocess.run([sys.executable, "-m", "meshllm.cli", "status", "--state-dir", str(a.state)],
                               capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "200"})
        assert "direct [fd00:6::2]:" in shown.stdout and "RPC direct [fd00:6::3]:" in shown.stdout, shown.stdout
        for w in (b, c):  # the host, by the address its TLS connection comes from
            assert (w.state / "rpc-server.keys").read_text().split()[1] == "fd00:6::1"
        logs = {w.name: (w.state / "rpc-server.log").read_text() for w in (b, c)}
        second = next(n for n in "bc" if "the host allows a predecessor at" in logs[n])
        first = "c" if second == "b" else "b"
        assert f"the host allows a predecessor at {ip[first]}" in logs[second], logs[second][-2000:]
        assert f"peer link to [{ip[second]}]:" in logs[first] and "connected" in logs[first], logs[first][-2000:]
        print(f"\nIPv6-only link: B and C connected to A {took:.1f} s after their start; split served over "
              f"{a.peer(b.id)['rpc_path']}, B and C linked worker to worker")  # type: ignore[index]
    finally:
        for n in nodes:
            n.stop()
