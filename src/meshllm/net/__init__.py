"""The asyncio shells that carry bytes and make no decisions: one UDP socket for QUIC and control packets
(``endpoint``), a peer connection (``conn``), the mesh's network (``meshnet``, ``meshauth``, ``traversal``), TCP over
QUIC streams (``tunnel``), added delay for benchmarks (``netem``), who is on the other end of a loopback socket
(``localuser``).

May import: ``proto/`` (every decision), ``machine/`` (the node's keys and members on disk) and the leaves
(``errors``, ``sockets``); never ``llama/``, ``serve/`` or ``cli/``."""
