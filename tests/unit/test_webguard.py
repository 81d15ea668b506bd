"""What a web page in the browser may ask of the API and the console (serve/http/webguard.py)."""

from __future__ import annotations

from meshllm.serve.http.webguard import host_ok, origin_ok, strip_cors


def test_only_loopback_hosts_on_a_loopback_server() -> None:
    for host in ("127.0.0.1:9337", "localhost:9337", "LOCALHOST", "[::1]:9337", "127.0.0.1", None, ""):
        assert host_ok(host, listen_all=False), host
    for host in ("rebind.evil.example", "rebind.evil.example:9337", "127.0.0.1.evil.example", "10.0.0.2:9337",
                 "localhost.evil.example:9337", "[::2]:9337"):  # fmt: skip
        assert not host_ok(host, listen_all=False), host
        assert host_ok(host, listen_all=True), host  # --listen-all: any name, the API key decides


def test_only_loopback_origins_and_no_origin_at_all() -> None:
    for origin in (None, "http://localhost:5173", "http://127.0.0.1:3131", "https://localhost", "http://[::1]:8080"):
        assert origin_ok(origin), origin
    for origin in ("https://evil.example", "http://127.0.0.1.evil.example", "null", "file://", "ftp://localhost",
                   "http://localhost.evil.example", "", "http://[::1"):  # fmt: skip
        assert not origin_ok(origin), origin


def test_the_upstreams_cors_headers_never_pass() -> None:
    got = strip_cors({"Access-Control-Allow-Origin": "https://evil.example", "access-control-allow-credentials": "true",
                      "Content-Type": "application/json"}.items())  # fmt: skip
    assert dict(got) == {"Content-Type": "application/json"}


def test_max_tokens_capped_where_configured() -> None:
    """A request for 10**9 tokens was passed on; --max-tokens caps what any request asks (and one that does
    not say), under every name llama-server takes."""
    from meshllm.serve.http.endpoints import cap_tokens

    assert cap_tokens({"prompt": "x", "max_tokens": 100}, 256) is None
    assert cap_tokens({"prompt": "x", "max_tokens": 10**9}, 256) == {"prompt": "x", "max_tokens": 256}
    assert cap_tokens({"prompt": "x"}, 256) == {"prompt": "x", "max_tokens": 256}
    assert cap_tokens({"prompt": "x", "n_predict": -1, "max_tokens": 5}, 256) == {"prompt": "x", "max_tokens": 5}
    assert cap_tokens({"messages": [], "max_completion_tokens": True}, 8) == {"messages": [], "max_tokens": 8}


def test_each_generating_endpoint_is_capped_by_the_field_it_honours() -> None:
    """/v1/messages reads max_tokens only (n_predict there is ignored: it generated 4096); /v1/responses
    reads max_output_tokens and passes every other field through (n_predict there went uncapped)."""
    from meshllm.serve.http.endpoints import ENDPOINTS, cap_tokens

    msgs, resp = ENDPOINTS["/v1/messages"], ENDPOINTS["/v1/responses"]
    assert cap_tokens({"messages": [], "n_predict": 5}, 16, msgs) == {"messages": [], "max_tokens": 5}
    assert cap_tokens({"messages": [], "max_tokens": 5}, 16, msgs) is None
    assert cap_tokens({"input": "x"}, 16, resp) == {"input": "x", "max_output_tokens": 16}
    assert cap_tokens({"input": "x", "max_output_tokens": 4, "n_predict": 10**9}, 16, resp) == {
        "input": "x", "max_output_tokens": 4}
    assert cap_tokens({"input": "x", "max_output_tokens": 4}, 16, resp) is None
    assert cap_tokens({"messages": [], "max_tokens": 10**9}, 16, ENDPOINTS["/v1/messages/count_tokens"]) is None
    assert cap_tokens({"input": "x"}, 16, ENDPOINTS["/v1/embeddings"]) is None  # generates nothing
    assert set(ENDPOINTS) == {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                              "/v1/messages/count_tokens", "/v1/embeddings"}  # none of llama-server's  # fmt: skip


def test_dot_segments_are_found_plain_and_encoded() -> None:
    from meshllm.serve.http.endpoints import dot_segments

    for bad in ("/v1/../completion", "/v1/%2e%2e/slots", "/v1/%2E./props", "/v1/.%2e/x", "/v1/./completions",
                "/v1/%252e%252e/slots", "/v1/x%2f..%2fslots", "/v1/..\\slots", "/v1/..?a=b"):  # fmt: skip
        assert dot_segments(bad), bad
    for ok in ("/v1/completions", "/v1/chat/completions?x=..", "/v1/models/a.b", "/v1/models/..a"):
        assert not dot_segments(ok), ok


def test_connection_limits_per_client_and_in_all() -> None:
    """The gate's bookkeeping (serve/http/gate.py); a full share or a full gate closes the
    oldest connection that never got past the key, and one that did is never closed for a newcomer."""
    from meshllm.serve.http.gate import ConnLimits

    c = ConnLimits(per_address=2, total=3)
    a1, a2, a3, b1, c1, k1 = (object() for _ in range(6))
    assert c.admit(a1, "a") == (True, None) and c.admit(a2, "a") == (True, None)
    assert c.admit(a3, "a") == (True, a1)  # a's share is full: its own oldest unproven one goes
    assert c.open == {"a": 2} and a1 not in c.owner
    c.proven(a2)
    assert c.admit(b1, "b") == (True, None)  # 3 in all now
    assert c.admit(c1, "c") == (True, a3)  # full: the oldest unproven of all goes (a2 proved itself: it stays)
    c.proven(b1)
    c.proven(c1)
    assert c.admit(k1, "k") == (False, None)  # full, and every connection proved itself: refused
    c.release(a2)
    c.release(a2)  # said twice (closed to make room, then its connection_lost): counted once
    assert c.open == {"b": 1, "c": 1} and c.admit(k1, "k") == (True, None)
    for x in (b1, c1, k1, a1):
        c.release(x)
    assert c.open == {} and not c.owner and not c.unproven


def test_a_client_is_its_network_or_its_local_user() -> None:
    """Thirteen addresses of one /64 held the gate; one client from many addresses the queue."""
    from meshllm.serve.http.gate import client_of

    assert client_of("2001:db8:1:2::1") == client_of("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert client_of("2001:db8:1:3::1") != client_of("2001:db8:1:2::1")
    assert client_of("192.0.2.7") == client_of("192.0.2.250") == client_of("::ffff:192.0.2.9") == "192.0.2.0/24"
    assert client_of("192.0.3.7") != client_of("192.0.2.7")
    assert client_of("127.0.0.2", 1000) == client_of("::1", 1000) == "local user 1000" != client_of("127.0.0.1", 0)
    assert client_of("127.0.0.5") == "local" and client_of("fe80::1%eth0") == "fe80::/64" and client_of("?") == "?"


def test_only_an_api_open_to_other_machines_bounds_one_address() -> None:
    """On loopback every client is 127.0.0.1 (agents of the user's, the host's door): only the total is bounded."""
    from meshllm.serve.http import gate
    from meshllm.serve.http.api import Api

    def limits(listen_all: bool) -> gate.ConnLimits:
        return Api(lambda _m: None, list, dict, api_key="k" if listen_all else None, listen_all=listen_all).limits

    assert limits(True).per_address == gate.PER_ADDRESS and limits(False).per_address == gate.TOTAL


def test_a_preflight_may_ask_for_well_formed_headers_only() -> None:
    from aiohttp.test_utils import make_mocked_request

    from meshllm.serve.http.webguard import preflight_headers

    ask = "x-stainless-os, X-Stainless-Lang, cookie, bad header, " + ", ".join(f"x-{i}" for i in range(40))
    req = make_mocked_request("OPTIONS", "/v1/chat/completions", headers={"Access-Control-Request-Headers": ask})
    got = [h.strip() for h in preflight_headers("Authorization, Content-Type", req).split(",")]
    assert got[:4] == ["Authorization", "Content-Type", "x-stainless-os", "X-Stainless-Lang"]
    assert "cookie" not in got and "bad header" not in got and len(got) <= 2 + 32
    plain = make_mocked_request("OPTIONS", "/v1/models")
    assert preflight_headers("Authorization, Content-Type", plain) == "Authorization, Content-Type"


def test_a_request_that_does_not_say_gets_the_default() -> None:
    """A chat without max_tokens ran 22 minutes (a base model never stops): it gets DEFAULT_TOKENS."""
    from meshllm.serve.http.endpoints import DEFAULT_TOKENS, ENDPOINTS, default_tokens

    chat, resp = ENDPOINTS["/v1/chat/completions"], ENDPOINTS["/v1/responses"]
    assert default_tokens({"messages": []}, chat) == {"messages": [], "max_tokens": DEFAULT_TOKENS}
    assert default_tokens({"messages": [], "max_tokens": None}, chat) == {"messages": [], "max_tokens": DEFAULT_TOKENS}
    assert default_tokens({"messages": [], "max_completion_tokens": 9}, chat) is None
    assert default_tokens({"input": "x"}, resp) == {"input": "x", "max_output_tokens": DEFAULT_TOKENS}
    assert default_tokens({"messages": []}, ENDPOINTS["/v1/messages/count_tokens"]) is None


def test_a_chat_to_a_base_model_stops_at_the_next_turn() -> None:
    """A base model's transcript turns are added to the stops a chat names itself, in each endpoint's
    field; completions and counts are left alone."""
    from meshllm.serve.http.endpoints import with_stops

    turns = ("\nUser:", "\nAssistant:")
    assert with_stops("/v1/chat/completions", {"messages": []}, turns) == {"messages": [], "stop": list(turns)}
    assert with_stops("/v1/chat/completions", {"stop": "END"}, turns) == {"stop": ["END", *turns]}
    assert with_stops("/v1/chat/completions", {"stop": ["\nUser:"]}, turns) == {"stop": ["\nUser:", "\nAssistant:"]}
    assert with_stops("/v1/chat/completions", {"stop": list(turns)}, turns) is None  # it has them all
    assert with_stops("/v1/chat/completions", {"stop": 5}, turns) is None  # llama-server answers the error
    assert with_stops("/v1/messages", {"messages": []}, turns) == {"messages": [], "stop_sequences": list(turns)}
    assert with_stops("/v1/completions", {"prompt": "x"}, turns) is None  # a completion continues text as asked
    assert with_stops("/v1/messages/count_tokens", {"messages": []}, turns) is None
    assert with_stops("/v1/chat/completions", {"messages": []}, ()) is None


def test_cors_echoes_only_an_origin_the_guard_lets_in() -> None:
    """(the mutation audit left the echo untested): a stream's CORS headers name the loopback origin that
    asked, never a foreign one, and nothing without an Origin."""
    from aiohttp.test_utils import make_mocked_request

    from meshllm.serve.http.webguard import cors_for

    def req(origin: str | None) -> object:
        return make_mocked_request("POST", "/v1/completions", headers={"Origin": origin} if origin else {})

    assert cors_for(req("http://localhost:5173")) == {"Access-Control-Allow-Origin": "http://localhost:5173",  # type: ignore[arg-type]
                                                      "Vary": "Origin"}  # fmt: skip
    assert cors_for(req("https://evil.example")) == {}  # type: ignore[arg-type]
    assert cors_for(req(None)) == {}  # type: ignore[arg-type]
