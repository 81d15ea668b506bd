"""A request checked and shaped before it goes anywhere (``serve/http/endpoints.shape``): one refusal per fault, in
the order a client fixes them, and the token limits capped where the node or its slot says."""

from __future__ import annotations

import json

from meshllm.serve.http.endpoints import DEFAULT_TOKENS, ENDPOINTS, Refused, Shaped, shape

COMPLETIONS = "/v1/completions"
EP = ENDPOINTS[COMPLETIONS]


def _shape(body: object, max_tokens: int | None = None, ctx: int | None = None) -> Shaped | Refused:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return shape(COMPLETIONS, EP, raw, max_tokens, ctx)


def test_each_fault_is_one_refusal_naming_its_field() -> None:
    assert _shape(b"{not json") == Refused("request body is not valid JSON")
    assert _shape([1, 2]) == Refused("request body must be a JSON object")
    assert _shape({"model": "m"}) == Refused("'prompt' is required", "prompt", "missing_required_parameter")
    assert _shape({"prompt": "x", "max_tokens": -3}) == Refused(
        "'max_tokens' must be a positive whole number", "max_tokens", "invalid_value")  # fmt: skip
    assert isinstance(_shape({"prompt": "x", "max_tokens": True}), Refused)  # a bool is no count


def test_a_request_within_every_limit_goes_as_it_came() -> None:
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 10}).encode()
    got = shape(COMPLETIONS, EP, body, 100, 4096)
    assert got == Shaped({"model": "m", "prompt": "x", "max_tokens": 10}, body, "m")


def test_token_limits_are_capped_by_the_node_the_default_and_the_slot() -> None:
    capped = _shape({"prompt": "x", "max_tokens": 10**9}, max_tokens=256)
    assert isinstance(capped, Shaped) and capped.parsed["max_tokens"] == 256 and capped.capped_to == 0
    assert json.loads(capped.body)["max_tokens"] == 256  # the body upstream says so too
    unsaid = _shape({"prompt": "x"})
    assert isinstance(unsaid, Shaped) and unsaid.parsed["max_tokens"] == DEFAULT_TOKENS and unsaid.model is None
    slot = _shape({"prompt": "x", "max_tokens": 100_000}, ctx=2048)
    assert isinstance(slot, Shaped) and slot.parsed["max_tokens"] == 2048 and slot.capped_to == 2048
