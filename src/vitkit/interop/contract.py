"""The converters' contract: every key of a source is read, or dropped by a named rule; anything else is an error
that lists the unread keys, so no file half-loads into a model that runs and is wrong."""
from __future__ import annotations

from typing import Iterable


class KeyLedger:
    """The keys of one source still to be accounted for."""

    def __init__(self, keys: Iterable[str], source: str) -> None:
        self.left = set(keys)
        self.source = source
        self.dropped: dict[str, list[str]] = {}  # rule -> keys it dropped

    def read(self, key: str) -> None:
        self.left.discard(key)

    def drop(self, keys: Iterable[str], rule: str) -> None:
        keys = sorted(k for k in keys if k in self.left)
        if keys:
            self.dropped.setdefault(rule, []).extend(keys)
            self.left.difference_update(keys)

    def finish(self, supported: str) -> dict[str, list[str]]:
        """Raise naming the unread keys, else return what was dropped and why."""
        if self.left:
            left = sorted(self.left)
            raise ValueError(f"{self.source}: {len(left)} key(s) not understood, so the file is not loaded (it would "
                             f"run without them and be wrong): {left[:12]}{' ...' if len(left) > 12 else ''}; "
                             f"supported: {supported}")
        return self.dropped
