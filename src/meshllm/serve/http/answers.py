"""What goes back to the client: JSON answers and errors in OpenAI's shape (an upstream's error passed on with
llama-server's library noise taken out), the tokens an answer carried counted for /metrics, a continued answer's
events stitched onto the first (no second role-only event, the replayed prefix left out, the first answer's ids), and
the SSE comments that keep a waiting client's connection alive."""

from __future__ import annotations

import json
import re
import time

from aiohttp import web

from meshllm.proto import resume
from meshllm.serve.http.metrics import Counters


class TokenTally:
    """Counts generated tokens in a response as it passes: SSE content events, or the JSON usage."""

    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.buf = b""
        self.tokens = 0
        self.tps = 0.0
        self.decode_s = 0.0
        self.text: list[str] = []  # the generated text, piece by piece (SSE)
        self.finished = False  # an event said why the answer ended (its finish_reason)

    def feed(self, chunk: bytes) -> None:
        if not self.sse:
            if len(self.buf) < (1 << 20):
                self.buf += chunk
            return
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data: {"):
                self._event(line[6:])

    def _event(self, raw: bytes) -> None:
        try:
            ev = json.loads(raw)
        except ValueError:
            return
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content") or ch.get("text")
            if piece:
                self.tokens += 1
                self.text.append(str(piece))
            self.finished = self.finished or bool(ch.get("finish_reason"))
        t = ev.get("timings")
        if isinstance(t, dict) and t.get("predicted_per_second"):
            self.tps = float(t["predicted_per_second"])
            self.decode_s = float(t.get("predicted_ms") or 0.0) / 1000.0

    def done(self, c: Counters) -> None:
        if not self.sse:
            try:
                obj = json.loads(self.buf)
                self.tokens = int((obj.get("usage") or {}).get("completion_tokens") or obj.get("tokens_predicted") or 0)
                t = obj.get("timings") or {}
                self.tps = float(t.get("predicted_per_second") or 0.0)
                self.decode_s = float(t.get("predicted_ms") or 0.0) / 1000.0
            except (ValueError, AttributeError, TypeError):
                return
        c.tokens_generated += self.tokens
        c.decode_seconds += self.decode_s
        if self.tps:
            c.last_tokens_per_second = self.tps


def json_response(status: int, obj: object, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=json.dumps(obj), content_type="application/json", headers=headers)


def error_response(
    status: int,
    message: str,
    kind: str,
    headers: dict[str, str] | None = None,
    *,
    code: str | None = None,
    param: str | None = None,
    extra: dict[str, object] | None = None,
) -> web.Response:
    """An error in OpenAI's shape: ``code`` a string such as "model_not_found" (or null), ``param`` the field at
    fault (or null); what the SDKs read into their exceptions. ``extra``: more fields of the error object."""
    err = {**(extra or {}), "message": message, "type": kind, "param": param, "code": code}
    return json_response(status, {"error": err}, headers)


_JSON_LIB = re.compile(r"\s*\[json\.exception\.[\w.]+\]")  # llama-server's JSON library speaking


_FIELD = re.compile(r"^Field '([\w.]{1,64})'")


def upstream_error(status: int, body: bytes, retry_after: str | None = None) -> web.Response:
    """llama-server's error (``{"error": {"code": 400, "message": ..., "type": ...}}``) in OpenAI's shape, as the
    API's own errors are: ``code`` a string or null, ``param`` the field at fault (or null), its JSON library's
    exception names left out of the message; its other fields kept (``n_prompt_tokens`` and ``n_ctx``
    of a context overflow), and ``retry_after`` (the host's 429 or 503 through a lite client) kept as Retry-After."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        err = None
    if not isinstance(err, dict):
        return error_response(status, body.decode(errors="replace")[:500] or f"the model server answered {status}",
                      "upstream_error")  # fmt: skip
    msg = _JSON_LIB.sub("", str(err.get("message") or f"the model server answered {status}"))
    field = _FIELD.match(msg)
    code = err.get("code")
    extra: dict[str, object] = {k: v for k, v in err.items() if k not in ("message", "type", "code", "param")
                                and isinstance(k, str) and (v is None or isinstance(v, int | float | str | bool))}
    wait = {"Retry-After": retry_after} if retry_after and retry_after.isdigit() else None
    return error_response(status, msg, str(err.get("type") or "invalid_request_error"), wait,
                  code=code if isinstance(code, str) else None, param=field.group(1) if field else None, extra=extra)


def without_role_only(events: bytes) -> bytes:
    """SSE events less a chat's opening event that carries only the assistant's role (a continued answer's second
    opening: the client already had one)."""
    keep = []
    for ev in events.split(b"\n\n"):
        if ev.startswith(b"data: {") and b'"role":"assistant"' in ev:
            try:
                ch = (json.loads(ev[6:]).get("choices") or [{}])[0]
            except (ValueError, AttributeError, IndexError):
                ch = {}
            delta = ch.get("delta") or {}
            if not delta.get("content") and not ch.get("finish_reason") and not delta.get("tool_calls"):
                continue
        keep.append(ev)
    return b"\n\n".join(keep)


def replayed(events: bytes, replay: resume.Replay) -> bytes:
    """SSE events of an answer generated again, as ``replay`` lets them through."""
    out = []
    for ev in events.split(b"\n\n"):
        if ev.startswith(b"data: {"):
            try:
                obj = json.loads(ev[6:])
            except ValueError:
                continue
            kept = replay.event(obj) if isinstance(obj, dict) else None
            if kept is not None:
                out.append(b"data: " + json.dumps(kept, separators=(",", ":")).encode() + b"\n\n")
        elif ev.strip():
            out.append(ev + b"\n\n")
    return b"".join(out)


def openai_ids(body: bytes) -> bytes:
    return body.replace(b'"id":"chatcmpl-', b'"id":"cmpl-')



KEEPALIVE_S = 2.0  # while a cut answer waits and is continued, the client gets an SSE comment at least this often
KEEPALIVE = b": mesh-llm: continuing the answer on another model server\n\n"  # SSE comment: clients skip it

class Beat:
    """A client's stream kept alive while its cut answer waits for the mesh and is replayed — an SSE
    comment (which clients skip) once ``KEEPALIVE_S`` passed without a byte; a client or proxy with a read timeout
    does not end the answer that is about to go on."""

    def __init__(self, resp: web.StreamResponse) -> None:
        self.resp = resp
        self.last = time.monotonic()

    def wrote(self) -> None:
        self.last = time.monotonic()

    async def tick(self) -> None:
        if time.monotonic() - self.last >= KEEPALIVE_S:
            await self.resp.write(KEEPALIVE)
            self.wrote()
