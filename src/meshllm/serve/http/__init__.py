"""The HTTP API every node serves on :9337 and its guards: the OpenAI-compatible API and where its bytes go
(``api``), what each endpoint takes and how a request is shaped (``endpoints``), where a request goes (``upstream``),
what goes back to the client (``answers``), the connection gate before any key is checked (``gate``), the host's slot
queue (``slotgate``), what a web page may ask (``webguard``), the Prometheus text of /metrics (``metrics``).

May import: ``proto/`` and ``llama/`` (an upstream's key), nothing else of ``serve/``: the API is told where a request
goes (a router callable) and what the node says (status, metrics callables) by ``serve/node.py``."""
