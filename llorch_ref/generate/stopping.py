"""Stop strings that may span tokens: text that could still become a stop string is held back."""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops):
        self.stops = [s for s in (stops or []) if s]
        self.pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Add decoded text; -> the text that is safe to emit now. After a match, self.matched is set and
        the matched text (and anything after it) is never emitted."""
        if self.matched is not None:
            return ""
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            idx, s = min(hits)
            self.matched = s
            out, self.pending = self.pending[:idx], ""
            return out
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        return out
