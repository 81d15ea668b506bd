"""Hold a decision until its new value has been stable for a while. Pure: every call takes ``now``."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Debouncer(Generic[T]):
    """``current`` follows proposals only once one has held for ``hold_s``; ``urgent`` adopts at once (the
    current value can no longer stand), and ``first_at_once`` adopts the very first proposal without waiting."""

    def __init__(self, hold_s: float, first_at_once: bool = False) -> None:
        self.hold_s = hold_s
        self.first_at_once = first_at_once
        self.current: T | None = None
        self._proposal: T | None = None
        self._since = 0.0
        self._adopted = False

    def propose(self, value: T | None, now: float, urgent: bool = False) -> T | None:
        if value != self._proposal:
            self._proposal, self._since = value, now
        if self._proposal != self.current and (
            urgent or (self.first_at_once and not self._adopted) or now - self._since >= self.hold_s
        ):
            self.current = self._proposal
            self._adopted = True
        return self.current
