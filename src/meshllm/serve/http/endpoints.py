"""The endpoints the API serves and how a request is shaped on its way upstream: the field each one requires, the
token limits it may carry (capped by ``--max-tokens``, a default where it names none), whether it fits its slot's
context, the stop strings a base model's chat gets, and the request paths refused before any routing (dot segments,
an embedding model asked for text). Pure functions of the request."""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass

# what each endpoint cannot do without (llama-server's own answer would leak its JSON library's exception text)
REQUIRED = {"/v1/completions": ("prompt", (str, list)), "/v1/chat/completions": ("messages", (list,)),
            "/v1/embeddings": ("input", (str, list))}  # fmt: skip


# every name a request may ask for a number of tokens under: OpenAI's two, llama-server's own, the Responses API's
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")


_OPENAI = frozenset({"max_tokens", "max_completion_tokens", "n_predict"})  # llama-server takes each of them here


@dataclass(frozen=True)
class Endpoint:
    """One of llama-server's endpoints that the API passes on (POST only): the fields llama-server reads the number
    of tokens to generate from there, and the one --max-tokens writes (None: it generates nothing)."""

    honoured: frozenset[str] = frozenset()
    cap_field: str | None = None


# the only paths passed on to llama-server; every other path under /v1 is 404 here, so llama-server's own endpoints
# (/slots, /props, /metrics, /v1/chat/completions/control, ...) are never reachable through the API
ENDPOINTS = {
    "/v1/chat/completions": Endpoint(_OPENAI, "max_tokens"),
    "/v1/completions": Endpoint(_OPENAI, "max_tokens"),
    "/v1/messages": Endpoint(frozenset({"max_tokens"}), "max_tokens"),  # llama-server reads max_tokens only
    # llama-server turns max_output_tokens into max_tokens and passes every other field through: all are honoured
    "/v1/responses": Endpoint(frozenset(TOKEN_FIELDS), "max_output_tokens"),
    "/v1/messages/count_tokens": Endpoint(),
    "/v1/embeddings": Endpoint(),  # an embedding model's (see ``kind_error``)
}


EMBEDDINGS = "/v1/embeddings"


BARE = ("/chat/completions", "/completions", "/embeddings")  # served as under /v1 (OpenAI's shape)


def kind_error(path: str, model: str, embedding: bool | None) -> str | None:
    """Why ``path`` cannot go to ``model`` — embeddings from a model that makes text, text from an
    embedding model — or None (also when the model's kind is not known here: its host's door says)."""
    if embedding is None or (path == EMBEDDINGS) == embedding:
        return None
    if embedding:
        return f"model {model!r} is an embedding model: it answers {EMBEDDINGS} only"
    return f"model {model!r} makes text, not embeddings: {EMBEDDINGS} needs an embedding model (one whose GGUF pools)"


def is_count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def cap_tokens(req: dict[str, object], cap: int, ep: Endpoint = ENDPOINTS["/v1/completions"]
               ) -> dict[str, object] | None:  # fmt: skip
    """A request to ``ep`` that could generate more than ``cap`` tokens (it asks for more under any name, or asks
    under no name ``ep`` honours: until the context is full) made to ask for at most ``cap`` under the one name that
    endpoint honours; None when it already does (or ``ep`` generates nothing)."""
    if ep.cap_field is None:
        return None
    asked = [req[f] for f in TOKEN_FIELDS if f in req]
    if any(f in req for f in ep.honoured) and all(is_count(n) and n <= cap for n in asked):  # type: ignore[operator]
        return None
    n = min((v for v in asked if is_count(v) and v <= cap), default=cap)  # type: ignore[type-var, operator]
    return {**{k: v for k, v in req.items() if k not in TOKEN_FIELDS}, ep.cap_field: n}


CAPPED_HEADER = "X-Mesh-Max-Tokens"  # on an answer whose request asked for more tokens than its slot holds


def over_context(req: dict[str, object], ctx: int) -> bool:
    """Whether a request asks for more tokens than a slot of ``ctx`` tokens holds, under any name."""
    return any(is_count(n) and n > ctx for n in (req.get(f) for f in TOKEN_FIELDS))  # type: ignore[operator]


def completions_asked(req: dict[str, object]) -> int:
    """How many completions a request asks for (``n``, llama-server's ``n_cmpl``): each takes a slot."""
    n = req.get("n_cmpl", req.get("n", 1))
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


DEFAULT_TOKENS = 4096  # what a request that does not say how many tokens gets, when --max-tokens sets no cap


def default_tokens(req: dict[str, object], ep: Endpoint) -> dict[str, object] | None:
    """A request to ``ep`` that says under no name ``ep`` honours how many tokens to generate, made to ask for
    DEFAULT_TOKENS (else llama-server generates until the slot's context is full: a base model never stops); None
    when it says (or ``ep`` generates nothing)."""
    if ep.cap_field is None or any(req.get(f) is not None for f in ep.honoured):
        return None
    return {**{k: v for k, v in req.items() if k not in ep.honoured}, ep.cap_field: DEFAULT_TOKENS}


# where a chat names its stops (llama-server's /v1/responses takes "stop" too, though OpenAI's has none)
STOP_FIELDS = {"/v1/chat/completions": "stop", "/v1/messages": "stop_sequences", "/v1/responses": "stop"}


def with_stops(path: str, req: dict[str, object], stops: tuple[str, ...]) -> dict[str, object] | None:
    """A chat to ``path`` with ``stops`` added to the stop strings it names itself; None when it has them all, is
    not a chat, or names its stops in a shape llama-server refuses (it answers the error)."""
    field = STOP_FIELDS.get(path)
    have = req.get(field) if field else None
    mine = [] if have is None else [have] if isinstance(have, str) else have if isinstance(have, list) else None
    more = [s for s in stops if mine is not None and s not in mine]
    return {**req, field: [*(mine or []), *more]} if field and more else None


def dot_segments(raw_path: str) -> bool:
    """Whether a request's path (as sent, before any decoding) has a '.' or '..' segment, plain or percent-encoded,
    or an encoded slash or backslash that could make one: such paths are refused, never normalised and passed on."""
    path = raw_path.split("?", 1)[0]
    low = path.lower()
    if "%2f" in low or "%5c" in low or "\\" in path:
        return True
    return any(urllib.parse.unquote(urllib.parse.unquote(seg)) in (".", "..") for seg in path.split("/"))



@dataclass(frozen=True)
class Refused:
    """A request refused before it goes anywhere (400, in OpenAI's shape)."""

    message: str
    param: str | None = None
    code: str | None = None


@dataclass(frozen=True)
class Shaped:
    """A request as it goes upstream: its JSON, its body (written again where a field changed), the model it names,
    and the context a slot holds where it asked for more tokens than that (0: it did not)."""

    parsed: dict[str, object]
    body: bytes
    model: str | None
    capped_to: int = 0


def shape(path: str, ep: Endpoint, body: bytes, max_tokens: int | None, slot_ctx: int | None) -> Shaped | Refused:
    """The request ``body`` for ``path`` checked and shaped: a JSON object (whatever its Content-Type says:
    llama-server parses every body as JSON) with the field ``path`` requires, token limits that are positive whole
    numbers, capped at ``max_tokens`` (or the default where it names none), and at what a slot of ``slot_ctx``
    tokens holds."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return Refused("request body is not valid JSON")
    if not isinstance(parsed, dict):
        return Refused("request body must be a JSON object")
    model = parsed["model"] if isinstance(parsed.get("model"), str) else None
    need = REQUIRED.get(path)
    if need is not None and not isinstance(parsed.get(need[0]), need[1]):
        return Refused(f"'{need[0]}' is required", need[0], "missing_required_parameter")
    bad = next((f for f in TOKEN_FIELDS if parsed.get(f) is not None and not is_count(parsed[f])), None)
    if bad is not None:
        return Refused(f"'{bad}' must be a positive whole number", bad, "invalid_value")
    capped = cap_tokens(parsed, max_tokens, ep) if max_tokens else default_tokens(parsed, ep)
    if capped is not None:
        parsed, body = capped, json.dumps(capped).encode()
    if slot_ctx and over_context(parsed, slot_ctx) and (fit := cap_tokens(parsed, slot_ctx, ep)) is not None:
        # more than a slot holds (max_tokens 10,000,000 was taken): as many as it holds, and a header says so (the
        # door's answer carries it back through every node)
        return Shaped(fit, json.dumps(fit).encode(), model, slot_ctx)
    return Shaped(parsed, body, model)
