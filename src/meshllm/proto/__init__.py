"""The protocol cores, pure: invite tokens, admission chains and signed words (``token``, ``admission``,
``signed``), the auth handshake and LAN knocks (``auth``, ``knock``), the wire (``wire``), peer records, gossip and
membership (``record``, ``gossip``, ``meshcore``, ``standing``), the election and the layer plan (``election``,
``planner`` on ``layout``, with ``spill`` and ``sizing``; ``capacity``, ``fleet``, ``serving``), reachability and
hole punching (``reach``), slots, fetches and resumed answers (``slots``, ``fetch``, ``resume``). Every entry takes
``now``; nothing here does I/O.

May import: only itself, ``errors``, the standard library (no asyncio, sockets or subprocesses) and pure libraries
(msgpack, cryptography)."""
