"""The request that continues a streamed answer cut mid-way."""

from __future__ import annotations

from meshllm.proto.resume import CHAT, COMPLETIONS, continuation


def test_a_completion_continues_from_its_prompt_and_the_text_sent() -> None:
    body = {"model": "m", "prompt": "Count: 1", "max_tokens": 50, "stream": True, "temperature": 0}
    got = continuation(COMPLETIONS, body, ", 2, 3", 6)
    assert got == {**body, "prompt": "Count: 1, 2, 3", "max_tokens": 44}
    assert body["prompt"] == "Count: 1"  # the client's request is left as it was
    assert continuation(COMPLETIONS, body, "", 0) == body  # nothing went out: the request again
    assert continuation(COMPLETIONS, body, "x" * 50, 50) is None  # nothing left to generate
    assert continuation(COMPLETIONS, {**body, "prompt": [1, 2, 3]}, "x", 1) is None  # tokens: not continued
    assert continuation(COMPLETIONS, {**body, "stream": False}, "x", 1) is None
    assert continuation(COMPLETIONS, {**body, "n": 2}, "x", 1) is None
    assert continuation("/v1/responses", body, "x", 1) is None
    no_cap = continuation(COMPLETIONS, {"prompt": "a", "stream": True}, "b", 1)
    assert no_cap == {"prompt": "ab", "stream": True}


def test_a_chat_continues_as_the_assistant_s_reply_begun() -> None:
    msgs = [{"role": "user", "content": "Count"}]
    body = {"messages": msgs, "max_completion_tokens": 9, "stream": True}
    got = continuation(CHAT, body, "1, 2", 3)
    assert got == {**body, "messages": [*msgs, {"role": "assistant", "content": "1, 2"}], "max_completion_tokens": 6}
    begun = {**body, "messages": [*msgs, {"role": "assistant", "content": "Sure: "}]}
    got = continuation(CHAT, begun, "1, 2", 3)
    assert got is not None and got["messages"][-1] == {"role": "assistant", "content": "Sure: 1, 2"}
    parts = {**body, "messages": [*msgs, {"role": "assistant", "content": [{"type": "text", "text": "x"}]}]}
    assert continuation(CHAT, parts, "1", 1) is None
    assert continuation(CHAT, {"messages": "hi", "stream": True}, "1", 1) is None


def _ev(text: str | None, finish: str | None = None, chat: bool = False) -> dict[str, object]:
    if chat:
        return {"choices": [{"delta": {"content": text} if text is not None else {}, "finish_reason": finish}]}
    return {"choices": [{"text": text or "", "finish_reason": finish}]}


def test_a_replay_passes_only_what_the_client_does_not_have() -> None:
    from meshllm.proto.resume import Replay

    r = Replay("1, 2, 3", chat=False)
    got = [r.event(_ev(p)) for p in ["1", ",", " 2", ", 3", ",", " 4"]]
    assert got[:4] == [None] * 4 and got[4] == _ev(",") and got[5] == _ev(" 4") and not r.diverged
    r = Replay("1, 2", chat=False)
    assert r.event(_ev("1, 2, 3")) == _ev(", 3")  # straddles the cut: only its new part
    assert r.event(_ev(None, "length")) == _ev(None, "length") and r.event({"usage": {}}) == {"usage": {}}
    r = Replay("1, 2", chat=False)
    assert r.event({"usage": {}}) is None  # nothing of the rest before the text catches up
    assert r.event(_ev("1, 3")) is None and r.diverged  # another text: the caller continues the prompt instead
    r = Replay("1, 2", chat=False)
    assert r.event(_ev("1")) is None and r.event(_ev(None, "stop")) is None and r.diverged  # ended short


def test_a_chat_replay_leaves_out_its_second_opening() -> None:
    from meshllm.proto.resume import Replay

    r = Replay("Hi", chat=True)
    opening = {"choices": [{"delta": {"role": "assistant", "content": None}, "finish_reason": None}]}
    assert r.event(opening) is None
    assert r.event(_ev("Hi", chat=True)) is None and r.event(_ev(" there", chat=True)) == _ev(" there", chat=True)
    assert r.event(_ev(None, "stop", chat=True)) == _ev(None, "stop", chat=True) and not r.diverged


def test_an_answer_is_replayed_up_to_the_bound_and_continued_after_one_prefill_beyond() -> None:
    """Up to REPLAY_MAX_TOKENS sent, the answer again from its start (the uninterrupted text); beyond,
    one prefill of the prompt and the text (benchmarks/resume_seam.py: a prefill does not keep that text)."""
    from meshllm.proto.resume import REPLAY_MAX_TOKENS, replays

    assert replays(0) and replays(REPLAY_MAX_TOKENS) and not replays(REPLAY_MAX_TOKENS + 1)
