"""The split a model runs as: what this node runs for the plan (``hosting``: our rpc-server, the llama-server a plan
wants, the tunnels to each worker), who may reach our rpc-server (``rpcgate``), the direct TCP + TLS path to each
worker (``direct``), API requests between nodes through each host's door (``door``), worker-to-worker links through
the mesh (``peerlinks``), the plan this node follows (``replanning``), where an API request goes (``routing``), what
the node tells the mesh about its llama-server (``telemetry``), and llama-server's serving options on the command line
(``serving_flags``).

May import: ``proto/``, ``net/``, ``llama/``, ``machine/`` (the worker's key file), ``serve/fetch`` (the model's
files), ``serve/http`` (the upstream an API request is given, the slot gate, the door's API) and
``serve/options.py``."""
