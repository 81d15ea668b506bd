"""The split a model runs as: what this node runs for the plan (``hosting``: our rpc-server, the llama-server a plan
wants, the direct and tunnel paths to each worker), worker-to-worker links through the mesh (``peerlinks``), the plan
this node follows (``replanning``), where an API request goes (``routing``), what the node tells the mesh about its
llama-server (``telemetry``), and llama-server's serving options on the command line (``serving_flags``).

May import: ``proto/``, ``net/``, ``llama/``, ``serve/fetch`` (the model's files), ``serve/http`` (the upstream an API
request is given, the slot gate) and ``serve/options.py``."""
