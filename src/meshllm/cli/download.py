"""``mesh-llm download [NAME] [--draft] [--join TOKEN]``: without a name the catalog; with one, the model from the
hub (``models/download.py``) or from the members of a mesh (``serve/life/joining.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from meshllm.cli import args as a
from meshllm.cli import console
from meshllm.errors import UserError


def add(sub: Any) -> None:
    pd = sub.add_parser(
        "download",
        help="list the model catalog, or download a model",
        description="Without a name: the catalog. With one: download it (and --draft, its draft).",
    )
    pd.add_argument("name", nargs="?", type=a.nonempty, help="catalog name (e.g. 32b, qwen3-32b)")
    pd.add_argument("--draft", action="store_true", help="also fetch its paired draft model")
    pd.add_argument("--models-dir", type=Path, metavar="DIR", help="where models go (default ~/.models)")
    pd.add_argument("--check", action="store_true", help="verify every catalog entry against the live hub")
    pd.add_argument("--join", type=a.nonempty, action="append", metavar="TOKEN",
                    help="fetch it from the members of this mesh that serve it (the hub if none does)")
    pd.add_argument("--join-file", action="append", metavar="PATH", help="file holding invite token(s)")
    pd.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshllm.models import catalog
    from meshllm.models.download import download_entry, download_file
    from meshllm.paths import models_dir

    where = models_dir(args.models_dir)
    if args.check:
        from meshllm.models.download import check_catalog

        out = Console(highlight=False)
        bad = check_catalog(lambda line: out.print(line, markup=False))
        out.print(f"{bad} of the catalog's entries differ from the hub" if bad else "the catalog matches the hub")
        return 1 if bad else 0
    if not args.name:
        from meshllm.models.tiny import tiny_target
        from meshllm.serve.report.tables import print_catalog

        print_catalog(Console(highlight=False), where, tiny_target().is_file())
        return 0
    from meshllm.serve.options import gather_tokens

    tokens = gather_tokens(args)
    if tokens:  # from the mesh's members: by a catalog name, the name the mesh serves it under, or its fingerprint
        import asyncio

        from meshllm.serve.life.joining import download_through_mesh

        path = asyncio.run(download_through_mesh(tokens, args.name, args.models_dir, console))
        console.print(f"[green]ready:[/] {args.name} at {path}")
        return 0
    entry = catalog.find(args.name)
    if entry is None:
        hints = catalog.closest(args.name)
        raise UserError(f"unknown model {args.name!r}" + (f"; did you mean {', '.join(hints)}?" if hints else ""))
    path = download_entry(entry, where)
    console.print(f"[green]ready:[/] {entry.name} at {path}")
    if args.draft:
        if not entry.draft:
            raise UserError(f"{entry.name} has no draft model in the catalog")
        d = catalog.find(entry.draft)
        assert d is not None
        dpath = download_file(d.repo, d.files[0], where) if not d.pypi else download_entry(d, where)
        console.print(f"[green]ready:[/] draft {d.name} at {dpath}")
    return 0
