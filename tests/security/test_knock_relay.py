"""And 6, performed against real nodes with real mDNS on this machine: a neighbour with no token announces
the founder's mesh under its own key, answers a real node's knocks "waiting" and relays each of them to the founder;
once the founder approves that node, it replays the node's knock and would take the approval's token and join with
it. Before: the knock named no recipient and the approval was an ordinary token — the neighbour took it and joined
with the scope the founder chose. Now the founder refuses a knock addressed to another node (nothing is listed from
the relay), the real node knocks at every announcer each round and gets its token from the founder, and that token
admits its key only. A second neighbour, heard only after the node's first look, answers "refused": the node
knocks there too (it looks again between rounds), and a refusal from one that is neither founder nor admin no
longer ends ``--join-lan``."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

from meshllm.proto import crypto
from meshllm.proto.knock import REFUSED, KnockAnswer
from tests.integration.meshlab import NodeProc, wait_for
from tests.integration.test_fleet import _founder
from tests.integration.test_lan import _announced, _approve
from tests.security.neighbour import neighbour


def test_a_neighbour_that_relays_knocks_gets_no_approval_and_a_fake_refusal_ends_nothing(
    tmp_path: Path, tiny_model: Path
) -> None:
    nodes: list[NodeProc] = []
    stop = threading.Event()
    relayed: list[KnockAnswer] = []  # what the founder answered the neighbour's relays
    stolen: list[str] = []
    threads: list[threading.Thread] = []
    try:
        a, _ = _founder(tmp_path, tiny_model, nodes)
        mesh = re.search(r"new mesh (\w{8})", a.text()).group(1)  # type: ignore[union-attr]
        wait_for(lambda: _announced(mesh), 30, "a's announcement on the LAN")
        a_id = crypto.node_id(a.key())
        mesh_id = crypto.mesh_id_for(a_id)
        a_addrs = json.loads((a.state / "node.json").read_text())["addrs"]

        def run(refuse: bool, ready: threading.Event) -> None:
            def on_answer(ans: KnockAnswer) -> None:
                relayed.append(ans)
                if ans.token:
                    stolen.append(ans.token)

            async def go() -> None:
                ready.set()
                await neighbour(mesh_id, a_id, a_addrs, "127.0.0.1", refuse, on_answer, stop)

            asyncio.run(go())

        def start_neighbour(refuse: bool) -> None:
            ready = threading.Event()
            th = threading.Thread(target=run, args=(refuse, ready))
            th.start()
            threads.append(th)
            assert ready.wait(30), "the neighbour did not start"

        start_neighbour(False)  # it relays and answers "waiting"
        b = NodeProc(tmp_path, "b", tiny_model, "--ctx-size", "1024", "--join-lan", mesh, "--name", "laptop-b")
        nodes.append(b)
        wait_for(lambda: f"asked to join mesh {mesh}" in b.text(), 60, "b's knock")
        # one that answers "refused" announces the mesh after b first looked: b hears it in a later look (before,
        # b knocked only where its first look found announcers, and never heard of this one; a founder heard late
        # the same)
        start_neighbour(True)
        wait_for(lambda: "neither the mesh's founder nor an admin" in b.text(), 30, "the denier's refusal")
        wait_for(lambda: len(relayed) >= 2, 30, "the neighbour to relay b's knocks")
        # the relayed knocks were refused (addressed to the neighbour): b is listed once, from its own knocks only
        assert all(r.state == REFUSED and "addressed to another node" in r.reason for r in relayed), relayed
        listed = _approve(a).stdout
        assert "laptop-b" in listed and listed.count("laptop-b") == 1, listed
        assert b.proc.poll() is None, b.text()[-2000:]  # the denier's refusal was a word, not the end
        ok = _approve(a, b.short(), "--scope", "host")
        assert ok.returncode == 0, ok.stderr
        wait_for(lambda: "joined mesh" in b.text(), 30, "b to join")
        time.sleep(2 * 2)  # two more rounds of the neighbour's relays, after the approval
        assert not stolen, stolen  # no token ever reached the neighbour
        assert all(r.state == REFUSED for r in relayed), relayed
        assert all(p not in a.peers() for p in ("relay", "denier"))
    finally:
        stop.set()
        for th in threads:
            th.join(30)
        for n in nodes:
            n.stop()
