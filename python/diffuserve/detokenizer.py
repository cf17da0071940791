"""Incremental detokenization: text deltas from token ids that arrive a few at a time.

Decoding each new token alone is wrong twice over: one character may span several byte
tokens (an emoji is four bytes), and some decoders treat a sequence's first token
specially (SentencePiece drops its leading space). So each step decodes a short window
that starts a little before the new tokens, and emits only what the new tokens add to
it; text whose last character is still incomplete (U+FFFD at the end) waits for the next
tokens, and so does text that ends in byte-fallback tokens (an invalid byte still to come
makes the whole run U+FFFDs: Tokenizer.ends_in_byte_run). Text ending in U+FFFDs that no
token will complete (bytes that are no UTF-8: a client may ask for thousands) goes out up to
its last _SETTLED_AFTER tokens, whose bytes settle what an incomplete character before them
is. The deltas concatenate to the
decode of all the tokens. Tokens without text (skipped special tokens, ids past the
vocabulary: Tokenizer.has_text) are left out of the windows, which change nothing of their
text, so that a long run of them is not decoded again at each step.

A checkpoint whose decoding cleans up spaces (Tokenizer.clean_up_tokenization_spaces: " ."
to ".", ...) has that done over the whole text so far, and its last _CLEAN_UP_HOLD characters
wait: text still to come can only change the clean-up's last few characters (each of its ten
replacements matches at most 4 characters, scanning left to right).
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Iterable, List

from .tokenizer import clean_up_tokenization

INCOMPLETE = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character
# A UTF-8 character lacks at most 3 bytes, and a token with text has a byte at least: the text
# before a window's last 3 tokens with text is what it stays (where the whole window's text
# begins with it, no character there was completed).
_SETTLED_AFTER = 3
_SETTLED_SCAN = 64
_CLEAN_UP_HOLD = 32  # > 10 replacements x 3 characters each may reach back


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, clean_up: bool = True):
        """clean_up: False gives the decoder's text without the tokenizer's clean-up, if it has one."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._pushed = 0  # tokens pushed so far
        self._text_at: List[int] = []   # where among them the tokens with text are
        self._text_ids: List[int] = []  # and their ids
        self._prefix_start = 0  # window start: the tokens before the ones last emitted
        self._read = 0          # tokens whose text has been emitted
        self._clean_up = clean_up and tokenizer.clean_up_tokenization_spaces
        self._raw = ""   # with clean-up: the text so far before it (what the windows gave)
        self._sent = 0   # and how much of its cleaned text has been returned

    def _cleaned(self, delta: str, final: bool) -> str:
        """The next piece of the cleaned-up text, given the next raw `delta`."""
        self._raw += delta
        text = clean_up_tokenization(self._raw)
        end = len(text) if final else max(self._sent, len(text) - _CLEAN_UP_HOLD)
        piece, self._sent = text[self._sent:end], end
        return piece

    @property
    def tokens_read(self) -> int:
        """How many of the tokens pushed the text given out so far covers."""
        return self._read

    @property
    def window_start(self) -> int:
        """Where the window of the next piece given out starts: its text is decode(window_start,
        end)'s past decode(window_start, the tokens before the piece)."""
        return self._prefix_start

    def decode(self, start: int, end: int) -> str:
        """The raw text (no clean-up) of the tokens pushed so far from `start` to `end`: the
        windows the deltas are cut from."""
        return self._tokenizer.decode_output(self._with_text(start, end), skip_special_tokens=self._skip_special,
                                             clean_up_tokenization_spaces=False)

    def _with_text(self, start: int, end: int) -> List[int]:
        """The ids of the tokens from `start` to `end` that have text."""
        return self._text_ids[bisect_left(self._text_at, start):bisect_left(self._text_at, end)]

    def _ends_in_byte_run(self) -> bool:
        """Whether the window's last token with text is a byte-fallback token: asked of that
        token alone, before any decoding, so that a long run held back costs nothing a token
        (decoding the window at each had made a run of n tokens, pushed one at a time, cost
        n^2)."""
        in_window = self._text_at and self._text_at[-1] >= self._prefix_start
        return bool(in_window) and self._tokenizer.ends_in_byte_run(self._text_ids[-1:], self._skip_special)

    def push(self, ids) -> str:
        """Adds tokens; returns the text they complete (possibly "")."""
        for i in ids:
            i = int(i)
            if self._tokenizer.has_text(i, self._skip_special):
                self._text_at.append(self._pushed)
                self._text_ids.append(i)
            self._pushed += 1
        return self._emit(final=False)

    def finish(self) -> str:
        """The text still held back, incomplete characters and all."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        delta = self._raw_delta(final)
        return self._cleaned(delta, final) if self._clean_up else delta

    def _raw_delta(self, final: bool) -> str:
        if self._read == self._pushed or (not final and self._ends_in_byte_run()):
            return ""
        before = self.decode(self._prefix_start, self._read)
        end, after = self._pushed, self.decode(self._prefix_start, self._pushed)
        if not final and after.endswith(INCOMPLETE):
            # Held back, the window would grow by every token of a run of U+FFFDs, each push
            # decoding it all again (8,000 such tokens, pushed one at a time, had taken 22 s).
            end, whole = self._settled_end(), after
            after = self.decode(self._prefix_start, end) if end > self._read else ""
            if not whole.startswith(after):
                return ""
        if not final and len(after) <= len(before):
            return ""
        self._prefix_start, self._read = self._read, end
        return after[len(before):]

    def _settled_end(self) -> int:
        """Where the tokens before the window's last _SETTLED_AFTER tokens with text end (the
        window's start where it has no more). A token whose vocabulary entry is empty counts
        for none: it has no byte (three of them had let out a character's first byte as a
        U+FFFD). Looked for among the last _SETTLED_SCAN tokens, else none."""
        first = bisect_left(self._text_at, self._prefix_start)
        seen = 0
        for k in range(len(self._text_at) - 1, max(first, len(self._text_at) - _SETTLED_SCAN) - 1, -1):
            seen += bool(self._tokenizer.token_strings([self._text_ids[k]])[0])
            if seen == _SETTLED_AFTER:
                return self._text_at[k] if k > first else self._prefix_start
        return self._prefix_start


def until_eos(token_ids: List[int], eos_token_ids: Iterable[int]) -> List[int]:
    """An output's tokens before its first EOS: the EOS ends the output but is not text."""
    eos = set(eos_token_ids)
    for i, token in enumerate(token_ids):
        if token in eos:
            return token_ids[:i]
    return token_ids
