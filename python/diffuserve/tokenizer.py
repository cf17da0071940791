"""Tokenizer: a checkpoint's tokenizer.json (through the `tokenizers` library), its special
tokens and its chat template, read from the files transformers writes:

    tokenizer.json           the tokenizer itself (required)
    tokenizer_config.json    special tokens (bos_token, eos_token, ...) and, in older
                             checkpoints, "chat_template" (a string or a list of named ones)
    chat_template.jinja      the chat template, in newer checkpoints (wins over the above)
"""
from __future__ import annotations

import json
import os
import stat
from typing import Dict, List, Optional, Tuple

from tokenizers import Tokenizer as _HFTokenizer

from . import _core
from ._checks import check_path, check_token_ids, check_unicode
from .chat_template import ChatTemplate

# Characters from which a text is encoded without holding the GIL (Tokenizer.encode): about
# 30 ms of encoding at a few MB/s.
_LONG_TEXT = 100_000


def _token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _named_special_tokens(config: dict) -> Dict[str, str]:
    """The named special tokens of tokenizer_config.json, as transformers (5) reads them and its
    chat templates see them: bos_token, eos_token, ..., a model's own "..._token" keys (Gemma 3's
    boi_token, say), and the named ones of extra_special_tokens (which win over those keys)."""
    named = {key: value for key, value in config.items() if key.endswith("_token")}
    extra = config.get("extra_special_tokens")
    named.update(extra if isinstance(extra, dict) else {})
    return {key: text for key, value in named.items() if (text := _token_text(value)) is not None}


def _present(file: str) -> bool:
    """Whether the checkpoint file `file` is there to read: a regular file (or a link to one)
    is, nothing is not; anything else (a FIFO, whose open would block until a writer came, a
    directory, a device, a broken link) is a CheckpointError naming it."""
    if not os.path.lexists(file):
        return False
    try:
        mode = os.stat(file).st_mode
    except OSError as e:
        raise _core.CheckpointError(f"{file}: cannot be read: {e}") from None
    if not stat.S_ISREG(mode):
        raise _core.CheckpointError(f"{file}: not a regular file")
    return True


def _read_chat_template(path: str, config: dict) -> Tuple[Optional[str], Dict[str, str]]:
    """The checkpoint's chat template, and its named ones (tokenizer_config.json's list form)."""
    template = config.get("chat_template")
    named = {}
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        named = {name: source for name, source in named.items() if isinstance(name, str) and isinstance(source, str)}
        template = named.get("default")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if _present(jinja_file):
        try:
            with open(jinja_file, encoding="utf-8") as f:
                return f.read(), named
        except (OSError, ValueError) as e:
            raise _core.CheckpointError(f"{jinja_file}: not a readable UTF-8 file: {e}") from None
    return (template if isinstance(template, str) else None), named


class Tokenizer:
    def __init__(self, path: str):
        """Reads the tokenizer files of checkpoint directory `path` (tokenizer.json must exist);
        a file that cannot be read is a CheckpointError naming it."""
        tokenizer_file = os.path.join(check_path("path (a checkpoint directory)", path), "tokenizer.json")
        if not _present(tokenizer_file):
            raise _core.CheckpointError(f"{tokenizer_file}: no such file")
        try:
            self._tokenizer = _HFTokenizer.from_file(tokenizer_file)
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise _core.CheckpointError(f"{tokenizer_file}: not a tokenizer the tokenizers library reads: {e}") \
                from None
        config = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if _present(config_file):
            try:
                with open(config_file, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise _core.CheckpointError(f"{config_file}: not a readable JSON file: {e}") from None
            if not isinstance(config, dict):
                raise _core.CheckpointError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
        self.special_tokens = _named_special_tokens(config)
        # Byte-fallback tokens (SentencePiece-style tokenizers, Gemma's): <0x00> ... <0xFF>.
        byte_ids = (self._tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256))
        self._byte_ids = frozenset(i for i in byte_ids if i is not None)
        self._special_ids = frozenset(i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special)
        template, self._named_templates = _read_chat_template(path, config)
        self.chat_template = ChatTemplate(template, self.special_tokens) if template else None

    @classmethod
    def from_checkpoint(cls, path) -> Optional["Tokenizer"]:
        """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json."""
        path = check_path("path (a checkpoint directory)", path)
        # (Anything there, a broken link too, is for the constructor's _present to judge.)
        return cls(path) if os.path.lexists(os.path.join(path, "tokenizer.json")) else None

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> Optional[int]:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self._tokenizer.token_to_id(eos)

    def token_id(self, token: str) -> Optional[int]:
        """The id of one vocabulary entry, or None."""
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids of `text`; add_special_tokens applies the tokenizer's post-processor
        (e.g. a leading <bos>), as transformers' encode does. Text that is not a valid Unicode
        string (a lone surrogate, say) is a ValueError. A text of _LONG_TEXT characters or more
        is encoded without holding the GIL: other threads run meanwhile."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        check_unicode("text", text)
        # The tokenizers library's encode holds the GIL throughout (a 5 MB text, ~15 s, stopped
        # every other thread, the server's event loop too); encode_batch lets go of it, the
        # same ids. Only for long texts: encode_batch marks the library's thread pool used, and
        # a process that forks after that gets its warning (and loses its parallelism).
        if len(text) < _LONG_TEXT:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of token ids. An id outside the vocabulary is a ValueError naming it (the
        tokenizers library writes nothing for one past it, and fails on a negative one)."""
        ids = check_token_ids(ids, "decode", self.vocab_size).tolist()
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_output(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of a model's output tokens. A checkpoint's embedding may have rows past
        the tokenizer's vocabulary (its vocab_size rounded up), which a model can sample: they
        have no text."""
        vocab_size = self.vocab_size
        ids = [int(i) for i in ids if i < vocab_size]
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def ends_in_byte_run(self, ids, skip_special_tokens: bool = True) -> bool:
        """Whether the last of `ids` that has text (skipped special tokens and ids past the
        vocabulary have none) is a byte-fallback token. The decoder writes a run of those as
        UTF-8 only when the whole run is valid, else one U+FFFD per byte: a token still to come
        may turn the run's text, complete characters and all, into U+FFFDs."""
        vocab_size = self.vocab_size
        for i in reversed(ids):
            if i < vocab_size and not (skip_special_tokens and i in self._special_ids):
                return i in self._byte_ids
        return False

    def apply_chat_template(self, messages: List[dict], add_generation_prompt: Optional[bool] = None,
                            chat_template: Optional[str] = None, tokenize: bool = False, **variables) -> str:
        """The prompt text of a conversation. Encode it with add_special_tokens=False: the
        template writes the special tokens itself. add_generation_prompt defaults to True (unless
        continue_final_message=True, which ends the text inside the final message, as in
        transformers). As in transformers, chat_template is a Jinja template, or the name of one
        of the checkpoint's named templates, to use instead of its own; tokenize must be False
        (this returns the text); other variables reach the template."""
        if tokenize is not False:
            raise ValueError(f"tokenize must be False (apply_chat_template returns the text; encode it with "
                             f"add_special_tokens=False), got {tokenize!r}")
        if chat_template is not None:
            if not isinstance(chat_template, str):
                raise ValueError(f"chat_template must be a Jinja template or a template's name (a string), "
                                 f"got {chat_template!r}")
            source = self._named_templates.get(chat_template, chat_template)
            return ChatTemplate(source, self.special_tokens).render(
                messages, add_generation_prompt=add_generation_prompt, **variables)
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json 'chat_template' "
                             "or chat_template.jinja)")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **variables)
