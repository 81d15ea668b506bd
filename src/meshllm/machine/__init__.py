"""The node on its machine: its files in the state dir (``state``), the signed words it leaves there for the running
node to gossip (``words``), the registry of the nodes running here with their logs and ``stop`` (``registry``), the
config file under its flags (``config``), a systemd user unit (``service``) and the checks of ``mesh-llm doctor``
(``doctor``).

May import: ``proto/`` (keys and signed words), ``llama/`` and ``models/`` (what doctor checks), and the leaves
(``errors``, ``paths``, ``sockets``); never ``net/``, ``serve/`` or ``cli/``, which build on it."""
