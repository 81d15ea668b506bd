"""Answers that survive their host, pure: the request that continues a streamed answer cut after some
text — the same request with that text appended to the prompt (a completion) or as the assistant's reply begun
(a chat: llama-server continues a final assistant message), and fewer tokens left to generate. Greedy, the
continuation gives the text the uninterrupted run would have."""

from __future__ import annotations

from typing import Any

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")
# a streamed answer cut after more tokens than this goes on after one prefill of the prompt and its text, not its
# regeneration token by token: the regeneration keeps the uninterrupted text (a prefill does not:
# benchmarks/resume_seam.py) but costs the client the tokens' decode time again
REPLAY_MAX_TOKENS = 128


def replays(sent_tokens: int) -> bool:
    """Whether an answer cut after ``sent_tokens`` is generated again from its start (``Replay``, the uninterrupted
    text) before its prompt is extended by the text instead (``continuation``, one prefill)."""
    return sent_tokens <= REPLAY_MAX_TOKENS


def continuation(path: str, body: dict[str, Any], sent_text: str, sent_tokens: int) -> dict[str, Any] | None:
    """The body that continues the streamed answer to ``body`` after ``sent_text`` (``sent_tokens`` tokens); None
    where it cannot be continued (not streamed, several choices, a prompt of tokens, nothing left to generate)."""
    if path not in (COMPLETIONS, CHAT) or body.get("stream") is not True or body.get("n") not in (None, 1):
        return None
    out = dict(body)
    for f in TOKEN_FIELDS:
        v = body.get(f)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            if v - sent_tokens <= 0:
                return None
            out[f] = v - sent_tokens
    if not sent_text:
        return out  # nothing of the answer went out: the request as it was
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return None
        out["prompt"] = prompt + sent_text
        return out
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return None
    last = msgs[-1] if msgs else None
    if isinstance(last, dict) and last.get("role") == "assistant":  # the client began the reply itself
        if not isinstance(last.get("content"), str):
            return None
        out["messages"] = [*msgs[:-1], {**last, "content": last["content"] + sent_text}]
    else:
        out["messages"] = [*msgs, {"role": "assistant", "content": sent_text}]
    return out


class Replay:
    """An answer generated again from the start on the next model server, less what the client already has: its
    events pass once their text goes beyond ``sent`` (an event that straddles it is cut), and the answer is the
    uninterrupted one — the same model computes the same greedy tokens the same way. A prompt extended by the
    text (``continuation``) is computed another way (one prefill, not token by token), and a near tie can then
    go the other way: the tiny model's counting answer did. ``diverged``: the new text left ``sent`` (other numerics
    on another plan): the caller continues the prompt instead."""

    def __init__(self, sent: str, chat: bool) -> None:
        self.sent, self.chat = sent, chat
        self.seen = ""
        self.diverged = False

    def event(self, ev: dict[str, Any]) -> dict[str, Any] | None:
        """``ev`` as the client gets it, or None to leave it out."""
        choices = ev.get("choices")
        ch = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if ch is None:
            return ev if self._past() else None
        raw = ch.get("delta")
        delta: dict[str, Any] = raw if isinstance(raw, dict) else {}
        piece = delta.get("content") if self.chat else ch.get("text")
        if not isinstance(piece, str) or not piece:
            if self.chat and not ch.get("finish_reason") and not delta.get("tool_calls"):
                return None  # the opening event (the assistant's role): the client had one
            if not self._past():
                self.diverged = self.diverged or bool(ch.get("finish_reason"))  # it ended short of what was sent
                return None
            return ev
        before = self.seen
        self.seen += piece
        if not (self.sent.startswith(self.seen) or self.seen.startswith(self.sent)):
            self.diverged = True
            return None
        if len(self.seen) <= len(self.sent):
            return None
        if len(before) >= len(self.sent):
            return ev
        rest = self.seen[len(self.sent) :]  # the part of this event the client does not have
        ch = {**ch, "delta": {**delta, "content": rest}} if self.chat else {**ch, "text": rest}
        return {**ev, "choices": [ch, *choices[1:]]}  # type: ignore[index]

    def _past(self) -> bool:
        return len(self.seen) >= len(self.sent)
