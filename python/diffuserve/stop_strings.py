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

import bisect
import math
from typing import List, Optional, Sequence, Tuple

from .detokenizer import INCOMPLETE, IncrementalDetokenizer
from .tokenizer import cleaned_positions


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


_SCANNED_PIECE = 16  # tokens of a piece whose every prefix TokensThrough decodes
_CLEAN_UP_REACH = 4  # the longest clean-up replacement: how far text to come reaches back into it


class TokensThrough:
    """How many of an output's tokens its text takes through character `end`: the fewest whose
    text begins with the output's first `end` characters (once a block where token ids go out
    beside stop strings, and once where a stop string ends the output). (The length of a
    prefix's text is no measure: one that ends inside a character's byte tokens decodes to a
    U+FFFD a byte, longer than the character, and a binary search on those lengths had stopped
    short.) One detokenizer takes each token once as the output grows, and the pieces it gives
    out say where its text reaches `end`; within a piece of several tokens (a byte run's, held
    back until the run ends) shorter prefixes' texts are decoded from the window that piece was
    cut from, as the detokenizer cut it: each of a short piece's, a long one's bisected. (The
    tokens had been replayed from the first on each call, and each candidate decoded from the
    first token: quadratic in the output's length.) Where the tokenizer cleans up spaces, the
    detokenizer gives the text before the clean-up, and `end` is first found in it (the count
    had run past the stop string, to the whole output, matching the cleaned text against the
    text before it)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer, clean_up=False)
        self._text = ""
        # At the end of each piece given out: tokens and characters so far; and where the
        # window it was cut from started.
        self._tokens, self._chars, self._windows = [0], [0], [0]
        self._fed = 0  # tokens given to the detokenizer
        self._finished = False  # and whether the text it held back was let out

    def _add(self, give_out) -> None:
        """The piece give_out() returns from the detokenizer, if any, recorded."""
        window = self._detokenizer.window_start
        piece = give_out()
        if piece:
            self._text += piece
            self._tokens.append(self._detokenizer.tokens_read)
            self._chars.append(len(self._text))
            self._windows.append(window)

    def __call__(self, token_ids: List[int], end: int, final: bool = False) -> int:
        """token_ids: the output so far (each call's starts with the last's); final: the output
        is over, and the text its detokenizer held back was let out (a stop string in it counts)."""
        if not self._tokenizer.clean_up_tokenization_spaces or end == 0:
            return self._through(token_ids, end, final)
        # The raw text through the cleaned text's character end - 1, read once the raw text
        # reaches far enough past it that text still to come cannot change its clean-up.
        while True:
            places = cleaned_positions(self._text)
            # (cleaning takes no character away from the text to come, so it needs at least
            # the characters the cleaned text lacks)
            missing = end + _CLEAN_UP_REACH - len(places)
            if missing <= 0 or not self._feed(token_ids, len(self._text) + missing, final):
                break
        if len(places) < end:
            return len(token_ids)
        wanted = "".join(self._text[k] for k in places[:end])  # the cleaned text's first `end` characters
        count = self._through(token_ids, places[end - 1] + 1, final)
        # The fewest tokens of the raw text have the cleaned text, but for a replacement that
        # the next tokens complete (" n" of " n't": "don" is cut from "do n't" by "'t").
        while count < len(token_ids) and not self._tokenizer.decode_output(token_ids[:count]).startswith(wanted):
            count += 1
        return count

    def take(self, token_ids: List[int]) -> None:
        """Reads the output so far ahead of a count, which then reads only what came since."""
        self._feed(token_ids, math.inf, False)

    def _feed(self, token_ids: List[int], end: int, final: bool) -> bool:
        """Gives the detokenizer tokens until its text reaches character `end` or the output
        is taken whole; whether it was given any."""
        fed = self._fed
        while self._chars[-1] < end and self._fed < len(token_ids):
            self._fed += 1
            self._add(lambda: self._detokenizer.push([token_ids[self._fed - 1]]))
        if final and self._chars[-1] < end and self._fed == len(token_ids) and not self._finished:
            self._finished = True
            self._add(self._detokenizer.finish)
            return True
        return self._fed > fed

    def _through(self, token_ids: List[int], end: int, final: bool) -> int:
        """The fewest tokens whose text before any clean-up begins with its first `end` characters."""
        self._feed(token_ids, end, final)
        if self._chars[-1] < end:
            return len(token_ids)
        i = bisect.bisect_left(self._chars, end)  # the piece that reaches `end`
        start, done, last = self._windows[i], self._tokens[i - 1], self._tokens[i]  # its window and tokens
        skip = len(self._detokenizer.decode(start, done))  # the window's text before the piece

        def text(m: int) -> str:  # the piece's text had it ended after m tokens
            return self._detokenizer.decode(start, m)[skip:]

        wanted = self._text[self._chars[i - 1]:end]
        if last - done <= _SCANNED_PIECE or INCOMPLETE in self._text[self._chars[i - 1]:self._chars[i]]:
            return next((m for m in range(done + 1, last) if text(m).startswith(wanted)), last)
        # A long piece (a byte run's) whose characters are all whole: a cut between two of them
        # gives a prefix of its text, and a cut inside one a U+FFFD; so over the cuts between
        # characters the prefix reaching `end` is a bisection's to find, and the fewest tokens
        # are at most the few from the cut inside a character before it. (Each decode takes
        # the piece's length: a scan of every cut had cost 25 s over a 12,000-token run.)
        def whole(m: int) -> Tuple[int, str]:  # the first cut from m on that splits no character, and its text
            piece = text(m)
            while m < last and INCOMPLETE in piece:
                m += 1
                piece = text(m)
            return m, piece

        low, high = done + 1, last
        while low < high:
            middle = (low + high) // 2
            if whole(middle)[1].startswith(wanted):
                high = middle
            else:
                low = middle + 1
        return next(m for m in range(low, whole(low)[0] + 1) if m == last or text(m).startswith(wanted))


class StopWatch:
    """An output's stop strings, looked for in its text as its blocks come, as the server's
    choices look for them in their streams (the offline LLM's)."""

    def __init__(self, tokenizer, stop: Sequence[str], include_stop: bool = False):
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._filter = StopStringFilter(stop, include_stop)
        self._through = TokensThrough(tokenizer)
        self.fed = 0   # tokens taken
        self.text = ""  # the text let out: once a stop string is found, through where it cuts the text

    @property
    def stop_string(self) -> Optional[str]:
        return self._filter.stop_string

    def push(self, token_ids: List[int], final: bool = False) -> Optional[int]:
        """token_ids: the output's tokens so far (each call's begin with the last's; no EOS);
        final: no more follow. Once a stop string is found, how many of the tokens its text
        takes through it; else None."""
        piece = self._detokenizer.push(token_ids[self.fed:])
        self.fed = len(token_ids)
        if final:
            piece += self._detokenizer.finish()
        self.text += self._filter.push(piece, final)
        if self._filter.stopped:
            return self._through(token_ids, self._filter.stop_end, final)
        # (Read a block at a time: the count had read a 32,000-token output in one step, 0.7 s.)
        self._through.take(token_ids)
        return None
