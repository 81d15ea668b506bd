"""A running node: ``node.py`` wires it together (the one place), ``options.py`` holds what it is told at start,
``preview.py`` what ``mesh-llm plan`` shows (the planner the nodes call, on the same snapshot); one package per
capability: the HTTP API (``http``), model files through the mesh (``fetch``), the split a model runs as
(``split``), the node's life in the mesh (``life``) and what it tells (``report``). Each package's docstring names
the others it may import.

May import: ``proto/``, ``net/``, ``llama/``, ``models/``, ``machine/`` and the leaves; never ``cli/``."""
