"""The error tree. Everything we raise on purpose derives from MeshError.

- UserError: bad input or environment; the CLI prints its message as one line and exits 2.
- LocalProtocolError: we tried to send something the protocol forbids (our bug).
- RemoteProtocolError: a peer sent something malformed; decoders raise only this.
- Refused: a peer turned us away on purpose (its reason in the message): not malformed, not our input.

A peer's bad input never becomes a UserError: it is refused and logged where it arrives. User input becomes one at
the boundary that takes it (the CLI, the node's start-up).
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


class Refused(MeshError):
    """A peer refused us (our token, our membership); the message carries its reason."""
