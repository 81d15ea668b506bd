"""mesh-llm: one large language model served by several ordinary machines."""

__version__ = "0.1.0"
