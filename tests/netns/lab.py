"""A NAT lab in network namespaces (root only): hosts behind Linux NAT boxes, a routed public segment between
them, and a rendezvous host on it. Everything lives in namespaces named with this lab's prefix and is removed by
``down()``, also when a test fails.

    homeA 192.168.1.2 --lan-- natA (192.168.1.1 | wan 198.51.100.2) --br0-- pub (router) --- rdv 198.51.100.10
    homeB 192.168.1.2 --lan-- natB (192.168.1.1 | wan 203.0.113.2)  -------- pub 203.0.113.1
    (homeA2 192.168.1.3 on homeA's LAN, with ``neighbour``)

Both homes use the same private subnet, as real homes do. NAT modes: ``cone`` (MASQUERADE keeps the source
port), ``random`` (MASQUERADE --random), each optionally ``+fw`` (drop unsolicited inbound on the wan), and
``blocked`` (cone, but UDP leaves only towards the rendezvous/relay host, as in some office networks). A
"public" node runs in a NAT box's own namespace: its wan address is public and nothing translates it.
Hops: homeA → natA → pub router → natB → homeB, so a packet sent with TTL 2 opens its own NAT and dies at the
router (the hole-punching trick depends on that hop).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field

TOOLS = ("ip", "iptables", "conntrack", "ethtool")
RDV = "198.51.100.10"


def why_not() -> str | None:
    """None when the lab can run here, else the reason (tests skip with it)."""
    if os.geteuid() != 0:
        return "the NAT lab needs root (network namespaces, iptables)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"the NAT lab needs {', '.join(missing)} (scripts/setup test installs them)"
    return None


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@dataclass
class Lab:
    prefix: str = field(default_factory=lambda: f"ml{os.getpid() % 100000}-")
    names: list[str] = field(default_factory=list)

    def ns(self, name: str) -> str:
        return self.prefix + name

    def n(self, name: str, *argv: str) -> None:
        sh("ip", "netns", "exec", self.ns(name), *argv)

    def up(self, mode_a: str = "cone", mode_b: str = "cone", neighbour: bool = False, v6: bool = False) -> Lab:
        """``neighbour``: a third home, homeA2 (192.168.1.3), on homeA's LAN behind natA (one NAT, one public
        address for both). ``v6``: IPv6 routed to homeA and homeB besides (``_routed_v6``)."""
        for name in ("homeA", "natA", "pub", "rdv", "natB", "homeB", *(("homeA2",) if neighbour else ())):
            sh("ip", "netns", "add", self.ns(name))
            self.names.append(name)
            self.n(name, "ip", "link", "set", "lo", "up")
        # public side: router with a bridge for rdv and natA, a routed link to natB
        self.n("pub", "ip", "link", "add", "br0", "type", "bridge")
        self.n("pub", "ip", "link", "set", "br0", "up")
        self.n("pub", "ip", "addr", "add", "198.51.100.1/24", "dev", "br0")
        self._veth("pub", "pa", "natA", "wan")
        self._veth("pub", "pr", "rdv", "eth0")
        self._veth("pub", "pb", "natB", "wan")
        for i in ("pa", "pr"):
            self.n("pub", "ip", "link", "set", i, "master", "br0")
        for i in ("pa", "pr", "pb"):
            self.n("pub", "ip", "link", "set", i, "up")
        self.n("pub", "ip", "addr", "add", "203.0.113.1/24", "dev", "pb")
        self.n("pub", "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self.n("rdv", "ip", "addr", "add", "198.51.100.10/24", "dev", "eth0")
        self.n("rdv", "ip", "link", "set", "eth0", "up")
        self.n("rdv", "ip", "route", "add", "default", "via", "198.51.100.1")
        for side, wan, gw in (("A", "198.51.100.2/24", "198.51.100.1"), ("B", "203.0.113.2/24", "203.0.113.1")):
            nat, home = f"nat{side}", f"home{side}"
            self.n(nat, "ip", "addr", "add", wan, "dev", "wan")
            self.n(nat, "ip", "link", "set", "wan", "up")
            self.n(nat, "ip", "route", "add", "default", "via", gw)
            homes = [(home, "lan", "192.168.1.2/24")] + ([("homeA2", "lan2", "192.168.1.3/24")]
                                                         if neighbour and side == "A" else [])  # fmt: skip
            lan = "lan"
            if len(homes) > 1:  # the homes on one LAN: a bridge in the NAT box
                lan = "lanbr"
                self.n(nat, "ip", "link", "add", lan, "type", "bridge")
            for h, port, addr in homes:
                self._veth(nat, port, h, "eth0")
                if lan != port:
                    self.n(nat, "ip", "link", "set", port, "master", lan)
                    self.n(nat, "ip", "link", "set", port, "up")
                self.n(h, "ip", "addr", "add", addr, "dev", "eth0")
                self.n(h, "ip", "link", "set", "eth0", "up")
                self.n(h, "ip", "route", "add", "default", "via", "192.168.1.1")
            self.n(nat, "ip", "addr", "add", "192.168.1.1/24", "dev", lan)
            self.n(nat, "ip", "link", "set", lan, "up")
            self.n(nat, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self.set_nat("natA", mode_a)
        self.set_nat("natB", mode_b)
        if v6:
            self._routed_v6("lanbr" if neighbour else "lan")
        return self

    def _routed_v6(self, lan_if: str) -> None:
        """IPv6 as ISPs hand it out, beside the IPv4 NATs: each home has a global address routed to it (no
        translation), behind its NAT box's stateful firewall (new connections from the wan dropped, as home routers
        do). homeA 2001:db8:a::2 via natA (wan 2001:db8:100::2), homeB 2001:db8:b::2 via natB (2001:db8:200::2);
        the rendezvous stays IPv4-only."""
        self.n("pub", "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
        self.n("pub", "ip", "-6", "addr", "add", "2001:db8:100::1/64", "dev", "br0", "nodad")
        self.n("pub", "ip", "-6", "addr", "add", "2001:db8:200::1/64", "dev", "pb", "nodad")
        for side, wan, up, net in (("A", "2001:db8:100::2", "2001:db8:100::1", "2001:db8:a"),
                                   ("B", "2001:db8:200::2", "2001:db8:200::1", "2001:db8:b")):  # fmt: skip
            nat, home = f"nat{side}", f"home{side}"
            self.n(nat, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
            self.n(nat, "ip", "-6", "addr", "add", f"{wan}/64", "dev", "wan", "nodad")
            self.n(nat, "ip", "-6", "route", "add", "default", "via", up)
            self.n(nat, "ip", "-6", "addr", "add", f"{net}::1/64", "dev", lan_if if side == "A" else "lan", "nodad")
            self.n(home, "ip", "-6", "addr", "add", f"{net}::2/64", "dev", "eth0", "nodad")
            self.n(home, "ip", "-6", "route", "add", "default", "via", f"{net}::1")
            self.n("pub", "ip", "-6", "route", "add", f"{net}::/64", "via", wan)
            self.n(nat, "ip6tables", "-A", "FORWARD", "-i", "wan", "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP")

    def up_v6(self) -> Lab:
        """Three hosts on one link with IPv6 addresses only (no IPv4 but loopback): v6a fd00:6::1 (on a
        bridge in its namespace), v6b fd00:6::2, v6c fd00:6::3; no duplicate address detection (they work at once)."""
        for name in ("v6a", "v6b", "v6c"):
            sh("ip", "netns", "add", self.ns(name))
            self.names.append(name)
            self.n(name, "ip", "link", "set", "lo", "up")
        self.n("v6a", "ip", "link", "add", "br0", "type", "bridge")
        self.n("v6a", "ip", "-6", "addr", "add", "fd00:6::1/64", "dev", "br0", "nodad")
        self.n("v6a", "ip", "link", "set", "br0", "up")
        for i, name in ((2, "v6b"), (3, "v6c")):
            self._veth("v6a", f"p{i}", name, "eth0")
            self.n("v6a", "ip", "link", "set", f"p{i}", "master", "br0")
            self.n("v6a", "ip", "link", "set", f"p{i}", "up")
            self.n(name, "ip", "-6", "addr", "add", f"fd00:6::{i}/64", "dev", "eth0", "nodad")
            self.n(name, "ip", "link", "set", "eth0", "up")
        return self

    def _veth(self, a: str, ia: str, b: str, ib: str) -> None:
        tmp_a, tmp_b = f"{self.prefix}{ia}x"[:15], f"{self.prefix}{ib}y"[:15]
        sh("ip", "link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
        sh("ip", "link", "set", tmp_a, "netns", self.ns(a))
        sh("ip", "link", "set", tmp_b, "netns", self.ns(b))
        self.n(a, "ip", "link", "set", tmp_a, "name", ia)
        self.n(b, "ip", "link", "set", tmp_b, "name", ib)

    def set_nat(self, nat: str, mode: str) -> None:
        fw = mode.endswith("+fw")
        mode = mode.removesuffix("+fw")
        self.n(nat, "iptables", "-t", "nat", "-F", "POSTROUTING")
        self.n(nat, "iptables", "-F", "INPUT")
        self.n(nat, "iptables", "-F", "FORWARD")
        if fw:
            self.n(nat, "iptables", "-A", "FORWARD", "-i", "wan", "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP")
        if mode == "blocked":
            self.n(nat, "iptables", "-A", "FORWARD", "-o", "wan", "-p", "udp", "!", "-d", RDV, "-j", "DROP")
        extra = {"cone": [], "random": ["--random"], "blocked": []}[mode]
        self.n(nat, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE", *extra)
        subprocess.run(["ip", "netns", "exec", self.ns(nat), "conntrack", "-F"], capture_output=True)

    def unblock(self, nat: str) -> None:
        """A ``blocked`` NAT box lets UDP out to anywhere from now on (connections it carries are untouched)."""
        self.n(nat, "iptables", "-D", "FORWARD", "-o", "wan", "-p", "udp", "!", "-d", RDV, "-j", "DROP")

    def exec_argv(self, name: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(name), *argv]

    def down(self) -> None:
        for name in self.names:
            ns = self.ns(name)
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:  # only what runs inside our own namespaces, by pid
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.names.clear()
