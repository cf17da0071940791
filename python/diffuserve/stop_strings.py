"""Stop strings: cut streamed text at the first occurrence of any of them.

Text arrives in pieces, and a stop string may straddle two pieces, so the last
len(longest stop) - 1 characters are held back until the next piece shows whether they
begin a stop string. A stop string never starts inside text already released, so the
search starts where the released text ends.

The text is cut before the stop string that ends first (of two ending together, the longer),
where generation token by token would stop, however the text is split into pieces (cutting
before the one that starts first did depend on it: of stops "abc" and "b", "ab" then "c"
found "b", "abc" at once found "abc").
"""
from __future__ import annotations

from typing import Sequence


class StopStringFilter:
    def __init__(self, stop: Sequence[str] = ()):
        if "" in stop:
            raise ValueError("stop strings: an empty string is not one")
        self._stop = list(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""       # everything received, up to a stop string
        self._released = 0    # characters of it handed out
        self.stopped = False  # a stop string was found; the rest of the output is dropped
        self.stop_end = 0     # once stopped: where in the text received that stop string ends

    def push(self, piece: str, final: bool = False) -> str:
        """Adds text; returns what is now safe to release. final: no more text follows."""
        if self.stopped:
            return ""
        self._text += piece
        found = [(i + len(s), i) for s in self._stop if (i := self._text.find(s, self._released)) >= 0]
        if found:
            self.stop_end, cut = min(found)
            self._text = self._text[:cut]
            self.stopped = True
            end = cut
        else:
            end = len(self._text) if final else max(self._released, len(self._text) - self._hold)
        out = self._text[self._released:end]
        self._released = end
        return out
