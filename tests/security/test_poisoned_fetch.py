"""1, performed against real nodes: a client-scoped member holds a copy of the mesh's model altered outside
the bytes the model fingerprint samples (so its record names the model's fingerprint) and serves it with a manifest
it signs honestly for its own bytes. Its node id sorts before the founder's. Before: every whole holder was a source
whatever its scope, the manifest most sources signed was believed and a tie went to the lowest node id — the liar's
— so a joiner with ``--fetch all`` took the altered file ("checked whole": the whole-file SHA-256 came from the same
manifest), and a joiner with the default ``--fetch layers`` took the altered layers into the founder's split. Now
only host-scoped holders decide what a model's bytes are: both joiners hold the founder's bytes, the liar carries
nothing, and the fetched file's SHA-256 is the model's."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from meshllm.llama.gguf import model_fingerprint
from meshllm.proto import crypto
from tests.integration.meshlab import NodeProc, in_process_source, serves, wait_for
from tests.integration.test_fetch import NAME, _rotted_copy
from tests.integration.test_fetch_layers import _ask
from tests.security.test_members import _mint


def _sha(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def test_a_client_scoped_member_cannot_make_a_fetched_model_its_own(tmp_path: Path, tiny_model: Path) -> None:
    from meshllm.proto import token as tok
    from meshllm.proto.record import ModelFacts
    from meshllm.serve.fetch.sharing import Sharing, _manifest_of

    nodes: list[NodeProc] = []
    sources = contextlib.ExitStack()
    try:
        a = NodeProc(tmp_path, "a", tiny_model, "--max-vram", "0.446", "--ctx-size", "1024")
        nodes.append(a)
        wait_for(lambda: (a.state / "token").exists() and (a.state / "status.json").exists(), 30, "a's token")
        a_id = bytes.fromhex(json.loads((a.state / "status.json").read_text())["node"])
        minted = _mint(a.state, "--scope", "client")
        assert minted.returncode == 0, minted.stderr
        token = tok.parse(minted.stdout.strip())
        key = next(k for k in iter(crypto.new_key, None) if crypto.node_id(k) < a_id)  # wins a tie by node id
        fp = model_fingerprint(tiny_model)
        state = tmp_path / "liar"
        state.mkdir(mode=0o700)
        honest = _manifest_of(tiny_model, fp, crypto.new_key(), tmp_path / "scratch")
        altered = tmp_path / "liar-models" / tiny_model.name
        altered.parent.mkdir()
        _rotted_copy(tiny_model, altered, honest)
        assert model_fingerprint(altered) == fp and _sha(altered) != _sha(tiny_model)
        facts = ModelFacts(fp, altered.stat().st_size, 18, NAME)

        # mesh-llm's own source, over its own (altered) file: a manifest signed honestly for those bytes
        sources.enter_context(in_process_source(key, state, token, Sharing(key, state, lambda: {fp: altered}), facts,
                                                "liar"))  # fmt: skip
        liar_short = crypto.short(crypto.node_id(key))
        wait_for(lambda: any(p.get("name") == "liar" and p.get("scope") == "client"
                             for p in a.status().get("peers", [])), 30, "a to know the liar")  # type: ignore[attr-defined]  # fmt: skip
        join = (a.state / "token").read_text().strip()

        # --fetch all: the whole file, checked whole against what the host vouches for
        models = tmp_path / "c-models"
        c = NodeProc(tmp_path, "c", None, "--model", NAME, "--fetch", "all", "--models-dir", str(models),
                     "--max-vram", "0.3", "--ctx-size", "1024", "--join", join, auto=True)  # fmt: skip
        nodes.append(c)
        wait_for(lambda: "fetched " in c.text() or "error" in c.text(), 180, "c's fetch")
        got = models / tiny_model.name
        assert got.is_file() and _sha(got) == _sha(tiny_model), c.text()[-3000:]
        done = next(ln for ln in c.text().splitlines() if "from the mesh in" in ln)
        assert a.short() in done and liar_short not in done, done
        c.stop()
        nodes.remove(c)

        # --fetch layers (the default): the worker's partial copy holds the founder's bytes, and the split answers
        d_models = tmp_path / "d-models"
        d = NodeProc(tmp_path, "d", None, "--model", NAME, "--models-dir", str(d_models), "--max-vram", "0.3",
                     "--ctx-size", "1024", "--join", join, auto=True)  # fmt: skip
        nodes.append(d)
        wait_for(lambda: serves(a, 2), 180, "a to serve a split with d")
        assert _ask(a.port).strip()
        part = d_models / ".partial" / f"{fp}.part"
        held = next(iter(json.loads((d_models / ".partial" / f"{fp}.have").read_text()).values()))
        assert len(held) > 1, held  # the header and d's layers
        with part.open("rb") as mine, tiny_model.open("rb") as model:
            for i in held:
                off, n = honest.span(i)
                mine.seek(off)
                model.seek(off)
                assert mine.read(n) == model.read(n), f"chunk {i} of d's copy is not the model's"
        assert liar_short not in "".join(ln for ln in d.text().splitlines() if "fetched layers" in ln)
    finally:
        sources.close()
        for n in nodes:
            n.stop()
