"""The protocol cores, pure: invite tokens, admission chains and signed words (``token``, ``admission``,
``signed``), the auth handshake and LAN knocks (``auth``, ``knock``), the wire (``wire``), gossip and membership
(``gossip``, ``meshcore``, ``standing``), the election and the layer plan (``election``, ``planner``, ``capacity``,
``fleet``, ``serving``), reachability and hole punching (``reach``), slots, fetches and resumed answers (``slots``,
``fetch``, ``resume``). Every entry takes ``now``; nothing here does I/O.

May import: only itself, ``errors``, the standard library (no asyncio, sockets or subprocesses) and pure libraries
(msgpack, cryptography)."""
