"""llama.cpp, as our processes: the pinned source and the patch series (``source``), what this machine
gives a build (``hardware``: CPU flags, GPU backends), cached builds (``build``, ``selftest``), a
bundle for machines with no compiler (``bundle``), GGUF files (``gguf``), the RPC wire (``rpcwire``), the children we
start and supervise (``processes``, ``supervisor``) and the chat template a base model gets (``chat``).

May import: ``models/`` (the tiny model a build tests itself on) and the leaves (``errors``, ``paths``, ``sockets``,
``delaytcp``); never the protocol, the network, the node or the command line."""
