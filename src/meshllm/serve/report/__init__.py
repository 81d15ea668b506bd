"""What a node tells: the status JSON, metrics and agent lines (``status``), the lines it prints about the mesh
(``narration``) in one terminal format (``terminal``), and the web console with its page (``console``, ``static/``).
Reads the node's parts, never changes them.

May import: ``proto/``, ``net/``, ``llama/``, ``models/``, ``serve/http`` and ``serve/split`` (what they count), and
``serve/life/lan.py`` (the console's approve and refuse buttons do what ``mesh-llm approve`` does)."""
