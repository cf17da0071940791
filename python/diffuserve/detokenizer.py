"""Incremental detokenization: text deltas from token ids that arrive a few at a time.

Decoding each new token alone is wrong twice over: one character may span several byte
tokens (an emoji is four bytes), and some decoders treat a sequence's first token
specially (SentencePiece drops its leading space). So each step decodes a short window
that starts a little before the new tokens, and emits only what the new tokens add to
it; text whose last character is still incomplete (U+FFFD at the end) waits for the next
tokens, and so does text that ends in byte-fallback tokens (an invalid byte still to come
makes the whole run U+FFFDs: Tokenizer.ends_in_byte_run). The deltas concatenate to the
decode of all the tokens.
"""
from __future__ import annotations

from typing import Iterable, List

_INCOMPLETE = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: List[int] = []
        self._prefix_start = 0  # window start: the tokens before the ones last emitted
        self._read = 0          # tokens whose text has been emitted

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode_output(self._ids[start:end], skip_special_tokens=self._skip_special)

    def push(self, ids) -> str:
        """Adds tokens; returns the text they complete (possibly "")."""
        self._ids.extend(int(i) for i in ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """The text still held back, incomplete characters and all."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._prefix_start, self._read)
        after = self._decode(self._prefix_start, len(self._ids))
        if not final and (len(after) <= len(before) or after.endswith(_INCOMPLETE)
                          or self._tokenizer.ends_in_byte_run(self._ids, self._skip_special)):
            return ""
        self._prefix_start, self._read = self._read, len(self._ids)
        return after[len(before):]


def until_eos(token_ids: List[int], eos_token_ids: Iterable[int]) -> List[int]:
    """An output's tokens before its first EOS: the EOS ends the output but is not text."""
    eos = set(eos_token_ids)
    for i, token in enumerate(token_ids):
        if token in eos:
            return token_ids[:i]
    return token_ids
