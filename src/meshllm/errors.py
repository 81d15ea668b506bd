"""The error tree. Everything we raise on purpose derives from MeshError.

- UserError: bad input or environment; the CLI prints its message as one line and exits 2.
- LocalProtocolError: we tried to send something the protocol forbids (our bug).
- RemoteProtocolError: a peer sent something malformed; decoders raise only this.
"""


class MeshError(Exception):
    """Root of all mesh-llm errors."""


class UserError(MeshError):
    """A problem the user can fix; the message is one line and says how."""


class BuildError(UserError):
    """Building or locating the llama.cpp binaries failed."""


class LocalProtocolError(MeshError):
    """We broke the protocol."""


class RemoteProtocolError(MeshError):
    """A peer broke the protocol."""
