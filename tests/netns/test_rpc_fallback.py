"""A direct RPC path that breaks mid-run falls back to the tunnel without losing the mesh: a firewall
rule (root: iptables on loopback) starts rejecting the worker's TLS port under a serving split, the host's
llama-server dies and cannot reconnect, and the next start goes through the QUIC tunnel with the same answer."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.integration.meshlab import serves, wait_for
from tests.integration.test_rpc_direct import _rpc_path
from tests.integration.test_serve_split import _assignments, complete, text_of, two_nodes

from .lab import why_not

REASON = why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def test_a_broken_direct_path_falls_back_to_the_tunnel(tmp_path: Path, tiny_model: Path) -> None:
    with two_nodes(tmp_path, tiny_model, ("--max-vram", "0.446"), ("--max-vram", "0.3")) as (a, _):
        wait_for(lambda: serves(a, 2), 120, "a two-way split")
        worker = str(_assignments(a)[0]["node"])
        m = re.fullmatch(r"direct 127\.0\.0\.1:(\d+) \(TLS\)", _rpc_path(a, worker))
        assert m, _rpc_path(a, worker)
        before = text_of(complete(a.port, "/v1/completions"))
        rule = ["INPUT", "-i", "lo", "-p", "tcp", "--dport", m.group(1), "-j", "REJECT", "--reject-with", "tcp-reset"]
        subprocess.run(["iptables", "-I", *rule], check=True)
        try:
            a.kill_child("llama-server")  # its connection is cut; the restarted one cannot get through
            gave_up = "through its tunnel while it stays a member"  # the host's line when the direct path fails
            wait_for(lambda: gave_up in a.text(), 90, "the host to give up the direct path")
            wait_for(lambda: _rpc_path(a, worker) == "tunnel", 120, "the split on the tunnel")
            wait_for(lambda: "llama-server ready" in a.text().split(gave_up)[-1], 120, "llama-server")
            assert text_of(complete(a.port, "/v1/completions")) == before
        finally:
            subprocess.run(["iptables", "-D", *rule], check=False)
