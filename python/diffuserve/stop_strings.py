"""Stop strings: cut streamed text at the first occurrence of any of them.

Text arrives in pieces, and a stop string may straddle two pieces, so the last
len(longest stop) - 1 characters are held back until the next piece shows whether they
begin a stop string. A stop string never starts inside text already released, and one not
found before a piece came must end inside it: each is looked for from len(s) - 1 characters
before the piece on, so that a piece costs its own length and the stop strings', not the
held-back text's for each stop string (long stop strings had made each piece cost minutes
of work over a long output).

The text is cut before the stop string that ends first (of two ending together, the longer),
where generation token by token would stop, however the text is split into pieces (cutting
before the one that starts first did depend on it: of stops "abc" and "b", "ab" then "c"
found "b", "abc" at once found "abc").
"""
from __future__ import annotations

from typing import Sequence


class StopStringFilter:
    def __init__(self, stop: Sequence[str] = (), include_stop: bool = False):
        """include_stop: the text released ends with the stop string found (vLLM's
        include_stop_str_in_output), not before it."""
        if "" in stop:
            raise ValueError("stop strings: an empty string is not one")
        self._stop = [(s, len(s) - 1) for s in stop]  # each with the characters it reaches back
        self._include_stop = include_stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""    # the text received and not yet handed out
        self._released = 0    # characters handed out
        self.stopped = False  # a stop string was found; the rest of the output is dropped
        self.stop_end = 0     # once stopped: where in the text received that stop string ends
        self.stop_string = None  # once stopped: the stop string found

    def push(self, piece: str, final: bool = False) -> str:
        """Adds text; returns what is now safe to release. final: no more text follows."""
        if self.stopped:
            return ""
        before = len(self._pending)
        self._pending += piece
        found = [(i + back + 1, i, s) for s, back in self._stop
                 if (i := self._pending.find(s, before - back if before > back else 0)) >= 0]
        if found:
            end, start, self.stop_string = min(found)
            self.stop_end = self._released + end
            cut = end if self._include_stop else start
            self.stopped = True
        else:
            cut = len(self._pending) if final else max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        self._released += cut
        return out
