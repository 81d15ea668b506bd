"""[trust-3] 2 and 6, performed against real nodes with real mDNS on this machine: a neighbour with no token announces
the founder's mesh under its own key, answers a real node's knocks "waiting" and relays each of them to the founder;
once the founder approves that node, it replays the node's knock and would take the approval's token and join with
it. Before: the knock named no recipient and the approval was an ordinary token — the neighbour took it and joined
with the scope the founder chose. Now the founder refuses a knock addressed to another node (nothing is listed from
the relay), the real node knocks at every announcer each round and gets its token from the founder, and that token
admits its key only. A second neighbour answers "refused": a refusal from one that is neither founder nor admin no
longer ends ``--join-lan``."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from pathlib import Path

from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from meshllm.net.meshnet import MeshNet
from meshllm.proto import crypto
from meshllm.proto.knock import REFUSED, WAITING, KnockAnswer, KnockAsk
from meshllm.serve.lan import SERVICE
from tests.integration.meshlab import NodeProc, wait_for
from tests.integration.test_fleet import _founder
from tests.integration.test_lan import _announced, _approve


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

        def neighbour(name: str, answer: str, ready: threading.Event) -> None:
            async def run() -> None:
                key = crypto.new_key()
                net = MeshNet(key, None, tmp_path / name, bind=("127.0.0.1", 0))
                (tmp_path / name).mkdir(mode=0o700)
                await net.start()
                loop = asyncio.get_running_loop()
                tasks: set[asyncio.Task[None]] = set()

                def on_knock(ask: KnockAsk, addr: str) -> KnockAnswer:
                    if answer == REFUSED:
                        return KnockAnswer(REFUSED, reason="this mesh is closed")

                    async def relay() -> None:  # to the founder, as it came: the knocking node's own signature
                        try:
                            got = await net.knock(a_id, a_addrs, ask)
                        except Exception:  # the attack goes on whatever fails
                            return
                        relayed.append(got)
                        if got.token:
                            stolen.append(got.token)

                    tasks.add(loop.create_task(relay()))
                    return KnockAnswer(WAITING)

                net.on_knock = on_knock
                port = net.ep.local_addr[1]
                info = AsyncServiceInfo(
                    SERVICE, f"{crypto.short(net.me)}.{SERVICE}", port=port, addresses=[socket.inet_aton("127.0.0.1")],
                    server=f"mesh-llm-{crypto.short(net.me)}.local.",
                    properties={"v": "1", "mesh": mesh_id.hex(), "node": net.me.hex(), "name": name},
                )  # fmt: skip
                zc = AsyncZeroconf(ip_version=IPVersion.V4Only)
                await zc.async_register_service(info)
                ready.set()
                try:
                    while not stop.is_set():
                        await asyncio.sleep(0.1)
                finally:
                    await zc.async_unregister_service(info)
                    await zc.async_close()
                    await net.stop(leave=False)

            asyncio.run(run())

        for name, answer in (("relay", WAITING), ("denier", REFUSED)):
            ready = threading.Event()
            th = threading.Thread(target=neighbour, args=(name, answer, ready))
            th.start()
            threads.append(th)
            assert ready.wait(30), f"the {name} did not announce"
        b = NodeProc(tmp_path, "b", tiny_model, "--ctx-size", "1024", "--join-lan", mesh, "--name", "laptop-b")
        nodes.append(b)
        wait_for(lambda: f"asked to join mesh {mesh}" in b.text(), 60, "b's knock")
        wait_for(lambda: len(relayed) >= 2, 30, "the neighbour to relay b's knocks")
        # the relayed knocks were refused (addressed to the neighbour): b is listed once, from its own knocks only
        assert all(r.state == REFUSED and "addressed to another node" in r.reason for r in relayed), relayed
        listed = _approve(a).stdout
        assert "laptop-b" in listed and listed.count("laptop-b") == 1, listed
        # the denier's refusal was a word, not the end
        assert "neither the mesh's founder nor an admin" in b.text() and b.proc.poll() is None, b.text()[-2000:]
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
