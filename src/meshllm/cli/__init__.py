"""The command line: one module per `mesh-llm` command, each adding its parser (``add``) and running it (``run``):
it parses and prints; what a command does lives in the package that owns it.

    mesh-llm [--model ...] [--join ...]     node.py       run a node (host, worker or --client)
    mesh-llm status                         status.py     the running node's view of the mesh
    mesh-llm plan MODEL                     plan.py       what the mesh would do with a model (serve/preview.py)
    mesh-llm download [NAME]                download.py   the catalog, or a model from the hub or the mesh
    mesh-llm build                          build.py      the llama.cpp binaries (llama/build.py)
    mesh-llm bundle                         bundle.py     binaries + wheels for a machine without a compiler
    mesh-llm token                          token.py      a new invite token
    mesh-llm approve / refuse               approve.py, refuse.py   answer a node that knocked from the LAN
    mesh-llm revoke / admin / rotate        revoke.py, admin.py, rotate.py   signed words (machine/words.py)
    mesh-llm serve / drop NAME              serve.py, drop.py        ask the mesh to serve or drop a model
    mesh-llm ps / stop / logs               ps.py, stop.py, logs.py  the nodes of this machine (machine/registry.py)
    mesh-llm service install|remove         service.py    a systemd user unit (machine/service.py)
    mesh-llm doctor                         doctor.py     what this machine has for a node (machine/doctor.py)

``main.py`` puts the parser together (with the config file under the node's flags) and runs the command; ``args.py``
holds the argument types.

May import: every other package of meshllm (it is the top); nothing of meshllm imports it.
"""

from __future__ import annotations

from rich.console import Console

console = Console(stderr=True, highlight=False, soft_wrap=True)  # notes and errors; answers go to stdout
