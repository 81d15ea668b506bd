"""Model files through the mesh: the files a node serves (``modelfiles``: the main model, its draft, its shape for the
planner), fetching them from members (``pull``: the whole file or a worker's layers; ``direct``: the TCP + TLS path
beside QUIC; ``fetching``: which file this node needs and when), and serving them to members (``sharing``).

May import: ``proto/``, ``net/``, ``llama/``, ``models/`` and ``serve/options.py``; no other package of ``serve/``."""
