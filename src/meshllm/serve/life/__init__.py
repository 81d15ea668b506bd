"""A node's life in the mesh: its start with every input checked before anything listens (``startup``), joining and
inviting (``joining``), a mesh found and joined on the LAN with approval (``lan``), and a ``--model auto`` node taking
up a model (``adoption``).

May import: ``proto/``, ``net/``, ``llama/``, ``models/``, ``serve/fetch``, ``serve/split``, ``serve/report`` (the lines
it prints) and ``serve/options.py``."""
