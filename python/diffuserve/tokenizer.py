"""Tokenizer: a checkpoint's tokenizer.json (through the `tokenizers` library), its special
tokens and its chat templates, read from the files transformers writes, as transformers reads
them:

    tokenizer.json           the tokenizer itself (required)
    tokenizer_config.json    special tokens (bos_token, eos_token, ..., extra_special_tokens or
                             additional_special_tokens), added_tokens_decoder,
                             split_special_tokens, clean_up_tokenization_spaces and, in older
                             checkpoints, "chat_template" (a string or a list of named ones)
    special_tokens_map.json  special tokens, in older checkpoints (where tokenizer_config.json
                             has no added_tokens_decoder)
    chat_template.jinja      the chat template, in newer checkpoints (wins over the above),
    additional_chat_templates/NAME.jinja   beside it, named ones
"""
from __future__ import annotations

import functools
import json
import os
import stat
from typing import Any, Dict, List, Optional, Tuple, Union

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

from . import _core
from ._checks import check_bool, check_path, check_token_ids, check_unicode
from .chat_template import ChatTemplate

# Characters from which a text is encoded without holding the GIL (Tokenizer.encode): about
# 30 ms of encoding at a few MB/s.
_LONG_TEXT = 100_000


# The named special tokens transformers knows by name; a checkpoint may name more ("..._token").
_STANDARD_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _added_token(value, file: str, where: str, special: bool) -> AddedToken:
    """A token as tokenizer_config.json stores it: a string, or an AddedToken dict (content, lstrip,
    rstrip, single_word, normalized, special); a named special token is special whatever it says."""
    if isinstance(value, str):
        return AddedToken(value, special=special, normalized=not special)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {k: value[k] for k in ("lstrip", "rstrip", "single_word", "normalized", "special") if k in value}
        if not all(isinstance(v, bool) for v in flags.values()):
            raise _core.CheckpointError(f"{file}: {where}: the AddedToken flags must be true or false: {value!r}")
        if special:
            flags["special"] = True
        return AddedToken(value["content"], **flags)
    raise _core.CheckpointError(f"{file}: {where} must be a string or an AddedToken object with a string "
                                f"'content', got {value!r}")


# The special tokens a tokenizer class of transformers names by default, where
# tokenizer_config.json does not name them (Gemma's adds a "<mask>" its tokenizer.json may lack).
_GEMMA_DEFAULTS = {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                   "mask_token": "<mask>"}
_CLASS_DEFAULTS = {"GemmaTokenizer": _GEMMA_DEFAULTS, "GemmaTokenizerFast": _GEMMA_DEFAULTS}
# transformers' apply_chat_template keywords that act on its tokenized output only, and those
# it refuses without tokenizing where they are set.
TOKENIZED_OUTPUT_ARGUMENTS = ("padding", "truncation", "max_length", "return_tensors", "return_dict",
                               "tokenizer_kwargs")
TOKENIZED_OUTPUT_ONLY = ("sanitize_control_tokens", "return_assistant_tokens_mask")
# apply_chat_template's own arguments, which a template's variables (chat_template_kwargs) may
# not set (the template could otherwise be swapped, or the messages replaced; "self" would fail
# the call; those of transformers' tokenized output would reach no template).
TEMPLATE_ARGUMENTS = {"messages", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize",
                      "self", *TOKENIZED_OUTPUT_ARGUMENTS, *TOKENIZED_OUTPUT_ONLY}
# The class where tokenizer_config.json names none: AutoTokenizer takes the model type's
# (config.json's "diffusion_gemma", the one model type the runtime loads).
_MODEL_TOKENIZER_CLASS = "GemmaTokenizer"


def _own_tokens(config: dict) -> Dict[str, Any]:
    """A model's own named special tokens among settings: "..._token" keys other than the
    standard ones (Gemma 3's boi_token), given as a string or an AddedToken ({"__type":
    "AddedToken", ...}: a dict without that type transformers passes over)."""
    return {key: value for key, value in config.items() if key not in _STANDARD_SPECIAL and key.endswith("_token")
            and (isinstance(value, str) or isinstance(value, dict) and value.get("__type") == "AddedToken")}


def _token_settings(config: dict, tokens_map_file: str) -> dict:
    """tokenizer_config.json's settings as transformers (5) hands them to the tokenizer: the
    config's additional_special_tokens (transformers 4's name) as its extra_special_tokens where
    it lists none under that name; the config's own named tokens and extra_special_tokens given
    as an object set apart under "model_specific_special_tokens"; then, only where the config
    has no added_tokens_decoder, special_tokens_map.json's settings over them (older checkpoints
    keep their special tokens there): its standard tokens win, its own named ones stay beside
    (the config's win over them), its extra_special_tokens list joins the config's, an object of
    them joins the config's own named ones, and its additional_special_tokens count where no
    extra_special_tokens are left. (Only own tokens given as strings are set apart: from_pretrained
    has not yet made the AddedToken dicts tokens, which the tokenizer then finds among the
    settings, where the map's win over them; where none is set apart, a model_specific_special_tokens
    the config holds stands.)"""
    settings = dict(config)
    if "additional_special_tokens" in settings and not settings.get("extra_special_tokens"):
        settings["extra_special_tokens"] = settings.pop("additional_special_tokens")
    own = {key: value for key, value in _own_tokens(settings).items() if isinstance(value, str)}
    for key in own:
        del settings[key]
    if isinstance(settings.get("extra_special_tokens"), dict):
        own.update(settings.pop("extra_special_tokens"))
    if not own and isinstance(config.get("model_specific_special_tokens"), dict):
        own = dict(config["model_specific_special_tokens"])
    if "added_tokens_decoder" not in config and _present(tokens_map_file):
        for key, value in _read_json_object(tokens_map_file).items():
            held = settings.get("extra_special_tokens")
            if key == "extra_special_tokens" and isinstance(value, list):  # (the map's are special, as read)
                value = [{**t, "special": True} if isinstance(t, dict) else t for t in value]
                value = held + [t for t in value if t not in held] if isinstance(held, list) else value
            elif isinstance(value, dict) and key != "extra_special_tokens":
                value = {**value, "__type": "AddedToken"}  # (the map's token dicts are made tokens as read)
            settings[key] = value
        if isinstance(settings.get("extra_special_tokens"), dict):
            own.update(settings.pop("extra_special_tokens"))
    if "additional_special_tokens" in settings and "extra_special_tokens" not in settings:
        settings["extra_special_tokens"] = settings.pop("additional_special_tokens")
    settings["model_specific_special_tokens"] = own
    return settings


def _special_tokens(settings: dict, file: str) -> Tuple[Dict[str, AddedToken], List[AddedToken]]:
    """The special tokens of the settings (_token_settings), as transformers (5) reads them:
    the named ones, in its order whatever the files' (save_pretrained sorts their keys; the
    tokenizer gives those it lacks their ids in this order): the standard ones (bos, eos, unk,
    sep, pad, cls, mask; a Gemma tokenizer's defaults where none is given), then a model's own
    ("..._token" keys, special_tokens_map.json's before the config's, which win, and
    extra_special_tokens given as an object, whose standard names take their standard place);
    and the unnamed ones (extra_special_tokens given as a list)."""
    tokenizer_class = settings.get("tokenizer_class")
    if tokenizer_class is not None and not isinstance(tokenizer_class, str):
        raise _core.CheckpointError(f"{file}: tokenizer_class must be a class name (a string), got {tokenizer_class!r}")
    settings = {**_CLASS_DEFAULTS.get(tokenizer_class or _MODEL_TOKENIZER_CLASS, {}), **settings}
    given = {key: settings[key] for key in _STANDARD_SPECIAL if settings.get(key) is not None}
    given.update({**_own_tokens(settings), **settings["model_specific_special_tokens"]})
    order = [key for key in _STANDARD_SPECIAL if key in given] + [key for key in given if key not in _STANDARD_SPECIAL]
    named = {key: _added_token(given[key], file, key, special=True) for key in order}
    listed = settings.get("extra_special_tokens")
    if isinstance(listed, list):
        return named, [_added_token(value, file, f"extra_special_tokens[{i}]", special=not isinstance(value, dict))
                       for i, value in enumerate(listed)]
    if listed is not None:
        raise _core.CheckpointError(f"{file}: extra_special_tokens must be a list of tokens or an object of named "
                                    f"ones, got {listed!r}")
    return named, []


def _listed_added_tokens(config: dict, file: str) -> Optional[List[AddedToken]]:
    """tokenizer_config.json's added_tokens_decoder ({id: AddedToken}), in the order of the ids;
    None where it has none."""
    listed = config.get("added_tokens_decoder")
    if listed is None:
        return None
    if not isinstance(listed, dict):
        raise _core.CheckpointError(f"{file}: added_tokens_decoder must be an object of id: token, got {listed!r}")
    tokens = []
    for key, value in listed.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise _core.CheckpointError(f"{file}: added_tokens_decoder: {key!r} is not a token id")
        tokens.append((int(key), _added_token(value, file, f"added_tokens_decoder.{key}", special=False)))
    return [token for _, token in sorted(tokens, key=lambda t: t[0])]


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


def _library_failure(e: BaseException) -> bool:
    """Whether the tokenizers library failed: its plain Exceptions, and its Rust panics
    (PanicException, a BaseException, raised on some malformed files)."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


def _read_json_object(file: str) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # (RecursionError: nested past Python's stack)
        raise _core.CheckpointError(f"{file}: not a readable JSON file: {e}") from None
    if not isinstance(value, dict):
        raise _core.CheckpointError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_text(file: str) -> str:
    try:
        with open(file, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:
        raise _core.CheckpointError(f"{file}: not a readable UTF-8 file: {e}") from None


def _read_chat_templates(path: str, config: dict, config_file: str) -> Union[None, str, Dict[str, str]]:
    """The checkpoint's chat template(s), as transformers reads them: the files
    chat_template.jinja (the default) and additional_chat_templates/NAME.jinja, which win over
    tokenizer_config.json's "chat_template" (a template, or a list of {name, template}); one
    template as a string, several as a dict by name."""
    templates = {}
    jinja_file = os.path.join(path, "chat_template.jinja")
    if _present(jinja_file):
        templates["default"] = _read_text(jinja_file)
    folder = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            file = os.path.join(folder, name)
            if name.endswith(".jinja") and _present(file):
                templates[name[:-len(".jinja")]] = _read_text(file)
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {}
        for i, entry in enumerate(template):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise _core.CheckpointError(f"{config_file}: chat_template[{i}] must be an object with a string "
                                            f"'name' and 'template'")
            named[entry["name"]] = entry["template"]
        return named
    if isinstance(template, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in template.items()):
        return template
    if template is not None and not isinstance(template, str):
        raise _core.CheckpointError(f"{config_file}: chat_template must be a template (a string) or a list of named "
                                    f"ones, got {type(template).__name__}")
    return template


# transformers' clean_up_tokenization: the spaces a WordPiece-style decoder leaves before
# punctuation and contractions, replaced in this order.
_CLEAN_UPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
              (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def clean_up_tokenization(text: str) -> str:
    for before, after in _CLEAN_UPS:
        text = text.replace(before, after)
    return text


def cleaned_positions(text: str) -> List[int]:
    """Where in `text` each character of clean_up_tokenization(text) comes from: the same
    replacements (each drops the spaces around its `after`), made as str.replace makes them,
    left to right without overlaps, with each kept character's place carried along."""
    current, places = text, list(range(len(text)))
    for before, after in _CLEAN_UPS:
        lead = len(before) - len(before.lstrip(" "))  # after is before less its outer spaces
        pieces, kept, i = [], [], 0
        while (j := current.find(before, i)) != -1:
            pieces += [current[i:j], after]
            kept += places[i:j] + places[j + lead:j + lead + len(after)]
            i = j + len(before)
        current = "".join(pieces) + current[i:]
        places = kept + places[i:]
    return places


class Tokenizer:
    def __init__(self, path: str):
        """Reads the tokenizer files of checkpoint directory `path` (tokenizer.json must exist);
        a file that cannot be read is a CheckpointError naming it."""
        self._file = os.path.join(check_path("path (a checkpoint directory)", path), "tokenizer.json")
        if not _present(self._file):
            raise _core.CheckpointError(f"{self._file}: no such file")
        try:
            self._tokenizer = _HFTokenizer.from_file(self._file)
        except BaseException as e:
            if not _library_failure(e):
                raise
            raise _core.CheckpointError(f"{self._file}: not a tokenizer the tokenizers library reads: {e}") from None
        config_file = os.path.join(path, "tokenizer_config.json")
        config = _read_json_object(config_file) if _present(config_file) else {}
        config = _token_settings(config, os.path.join(path, "special_tokens_map.json"))
        # transformers' encode neither truncates nor pads unless asked to: settings saved in
        # tokenizer.json had cut every prompt (chat prompts too) or padded it.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        named, extra = _special_tokens(config, config_file)
        self._add_config_tokens(_listed_added_tokens(config, config_file), named, extra)
        # split_special_tokens: special tokens written in text are text, not the tokens.
        self._split_special_tokens = config.get("split_special_tokens", False) is True
        self._tokenizer.encode_special_tokens = self._split_special_tokens
        self.special_tokens = {key: token.content for key, token in named.items()}
        # Byte-fallback tokens (SentencePiece-style tokenizers, Gemma's): <0x00> ... <0xFF>.
        byte_ids = (self._tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256))
        self._byte_ids = frozenset(i for i in byte_ids if i is not None)
        self._special_ids = frozenset(i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special)
        # One past the highest id: a vocabulary's ids may leave gaps, where the library's
        # get_vocab_size counts its entries.
        self._vocab_size = max(self._tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        # transformers leaves BPE's text alone unless told it may corrupt it, also where a decode
        # call asks for the clean-up.
        clean_up = config.get("clean_up_tokenization_spaces", False)
        forced = config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        self._may_clean_up = type(self._tokenizer.model).__name__ != "BPE" or bool(forced)
        self.clean_up_tokenization_spaces = bool(clean_up) and self._may_clean_up
        # The chat template(s): compiled when first used, so that a checkpoint whose template does
        # not compile still encodes and decodes (transformers fails in apply_chat_template alone).
        self.chat_template = _read_chat_templates(path, config, config_file)
        self._compiled: Dict[str, ChatTemplate] = {}
        self._library(self._tokenizer.encode, "a", add_special_tokens=True)  # a post-processor that cannot run

    def _add_config_tokens(self, listed: Optional[List[AddedToken]], named: Dict[str, AddedToken],
                           extra: List[AddedToken]) -> None:
        """tokenizer_config.json's tokens into the tokenizer, as transformers adds them: its
        added_tokens_decoder (`listed`) first, those tokenizer.json lacks after its vocabulary and
        those it has with the config's flags (special where either says so); then the special
        tokens. A named one (bos_token, ..., a model's own "..._token") is special, with the flags
        of the added token it names (lstrip, rstrip, ...: a string in the config says nothing of
        them), where added_tokens_decoder lists that token or the config has none (transformers
        looks the names up there, and else in tokenizer.json); one that tokenizer.json alone has
        stays as it is, and so does an unnamed one (extra_special_tokens) the tokenizer has.
        Special tokens the tokenizer lacks are added as the config gives them. Special tokens are
        matched whole in text and skipped in decoding."""
        def added() -> Dict[str, AddedToken]:
            return {t.content: t for t in self._tokenizer.get_added_tokens_decoder().values()}

        def like(token: AddedToken, special: bool) -> AddedToken:
            return AddedToken(token.content, single_word=token.single_word, lstrip=token.lstrip,
                              rstrip=token.rstrip, normalized=token.normalized, special=special)

        present, looked_up = added(), None if listed is None else {t.content for t in listed}
        listed = listed or []
        self._library(self._tokenizer.add_tokens, [t for t in listed if t.content not in present])
        # Those it has, in one call a kind (the library rebuilds its matcher at each call, and a
        # Gemma config lists thousands).
        relisted = [like(t, t.special or present[t.content].special) for t in listed if t.content in present]
        self._library(self._tokenizer.add_special_tokens, [t for t in relisted if t.special])
        self._library(self._tokenizer.add_tokens, [t for t in relisted if not t.special])
        present = added()
        self._library(self._tokenizer.add_special_tokens, [
            like(present[t.content], True) for t in named.values()
            if t.content in present and (looked_up is None or t.content in looked_up)])
        # Those it lacks in one call, their ids in order, each special as it says (an unnamed
        # one given as an AddedToken may say it is not, and transformers adds it so); a token
        # named again (an unnamed one as a named one) as it came first.
        new = {}
        for t in [*named.values(), *extra]:
            if t.content not in present:
                new.setdefault(t.content, t)
        self._library(self._tokenizer.add_tokens, list(new.values()))

    def __setstate__(self, state: dict) -> None:
        """A copy or an unpickled tokenizer: the tokenizers library's own state leaves
        encode_special_tokens out (copies had read special tokens written in text as the
        tokens, where split_special_tokens says they are text)."""
        self.__dict__.update(state)
        self._tokenizer.encode_special_tokens = self._split_special_tokens

    def _library(self, method, *args, **kwargs):
        """A call into the tokenizers library, whose failures on well-formed input are the
        checkpoint's (a post-processor naming a token it lacks panics in Rust, a BaseException):
        a CheckpointError naming tokenizer.json."""
        try:
            return method(*args, **kwargs)
        except BaseException as e:
            if not _library_failure(e):
                raise
            raise _core.CheckpointError(f"{self._file}: the tokenizer fails: {type(e).__name__}: {e}") from None

    @classmethod
    def from_checkpoint(cls, path) -> Optional["Tokenizer"]:
        """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json."""
        path = check_path("path (a checkpoint directory)", path)
        # (Anything there, a broken link too, is for the constructor's _present to judge.)
        return cls(path) if os.path.lexists(os.path.join(path, "tokenizer.json")) else None

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one token stands for in text (its vocabulary entry's length, at
        least what it matches): a text of n characters is at least n / this many tokens."""
        return max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @property
    def vocab_size(self) -> int:
        """One past the highest token id."""
        return self._vocab_size

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
        add_special_tokens = check_bool("add_special_tokens", add_special_tokens)  # (else blamed on tokenizer.json)
        # The tokenizers library's encode holds the GIL throughout (a 5 MB text, ~15 s, stopped
        # every other thread, the server's event loop too); encode_batch lets go of it, the
        # same ids. Only for long texts: encode_batch marks the library's thread pool used, and
        # a process that forks after that gets its warning (and loses its parallelism).
        if len(text) < _LONG_TEXT:
            return self._library(self._tokenizer.encode, text, add_special_tokens=add_special_tokens).ids
        return self._library(self._tokenizer.encode_batch, [text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True, clean_up_tokenization_spaces: Optional[bool] = None) -> str:
        """The text of token ids. An id outside the vocabulary is a ValueError naming it (the
        tokenizers library writes nothing for one past it, and fails on a negative one).
        clean_up_tokenization_spaces (default: the checkpoint's, as transformers reads it) drops
        the spaces a WordPiece-style decoder leaves before punctuation; as in transformers, not
        from a BPE tokenizer's text unless its config forces it (the clean-up corrupts that)."""
        ids = check_token_ids(ids, "decode", self.vocab_size).tolist()
        return self._decode(ids, skip_special_tokens, clean_up_tokenization_spaces)

    def decode_output(self, ids, skip_special_tokens: bool = True,
                      clean_up_tokenization_spaces: Optional[bool] = None) -> str:
        """The text of a model's output tokens. A checkpoint's embedding may have rows past
        the tokenizer's vocabulary (its vocab_size rounded up), which a model can sample: they
        have no text."""
        ids = check_token_ids(ids, "decode_output", 2**31 - 1).tolist()
        vocab_size = self.vocab_size
        return self._decode([i for i in ids if i < vocab_size], skip_special_tokens, clean_up_tokenization_spaces)

    def _decode(self, ids: List[int], skip_special_tokens: bool, clean_up: Optional[bool]) -> str:
        # (A flag of another type had failed in the library, and been blamed on tokenizer.json.)
        skip_special_tokens = check_bool("skip_special_tokens", skip_special_tokens)
        if clean_up is not None:
            clean_up = check_bool("clean_up_tokenization_spaces", clean_up)
        text = self._library(self._tokenizer.decode, ids, skip_special_tokens=skip_special_tokens)
        clean_up = self.clean_up_tokenization_spaces if clean_up is None else clean_up and self._may_clean_up
        return clean_up_tokenization(text) if clean_up else text

    def token_strings(self, ids) -> List[str]:
        """Each id's token as the vocabulary writes it (transformers' convert_ids_to_tokens)."""
        return [self._tokenizer.id_to_token(int(i)) for i in ids]

    def has_text(self, token_id: int, skip_special_tokens: bool = True) -> bool:
        """Whether decode_output gives the id to the decoder: skipped special tokens, ids past
        the vocabulary and those of its gaps are dropped first, so they change no other token's
        text (a gap's id between two byte tokens had been taken to end their run)."""
        return (token_id < self.vocab_size and self._tokenizer.id_to_token(token_id) is not None
                and not (skip_special_tokens and token_id in self._special_ids))

    def ends_in_byte_run(self, ids, skip_special_tokens: bool = True) -> bool:
        """Whether the last of `ids` that has text (has_text) is a byte-fallback token. The
        decoder writes a run of those as UTF-8 only when the whole run is valid, else one U+FFFD
        per byte: a token still to come may turn the run's text, complete characters and all,
        into U+FFFDs."""
        for i in reversed(ids):
            if self.has_text(i, skip_special_tokens):
                return i in self._byte_ids
        return False

    def get_chat_template(self, chat_template: Optional[str] = None, tools=None) -> str:
        """The template apply_chat_template renders, chosen as transformers chooses it: the
        given one (a template, or the name of one of the checkpoint's named templates), else
        the checkpoint's ("tool_use" among named ones when there are tools, else "default").
        A ValueError when there is none."""
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be a Jinja template or a template's name (a string), "
                             f"got {chat_template!r}")
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"this checkpoint has several chat templates and none named 'default': name one "
                             f"(chat_template=...) of {sorted(templates)}")
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json 'chat_template' "
                             "or chat_template.jinja)")
        return templates

    def apply_chat_template(self, messages: List[dict], add_generation_prompt: Optional[bool] = None,
                            chat_template: Optional[str] = None, tokenize: bool = False, tools=None,
                            **variables) -> str:
        """The prompt text of a conversation. Encode it with add_special_tokens=False: the
        template writes the special tokens itself. add_generation_prompt defaults to True (unless
        continue_final_message, which ends the text inside the final message, as in
        transformers). As in transformers, chat_template is a Jinja template, or the name of one
        of the checkpoint's named templates, to use instead of its own (get_chat_template);
        tools are JSON schemas; tokenize must be False (this returns the text), so transformers'
        padding, truncation, max_length, return_tensors, return_dict and tokenizer_kwargs do
        nothing, and sanitize_control_tokens or return_assistant_tokens_mask set is a ValueError;
        other variables (documents=..., a template's own switches) reach the template."""
        if tokenize is not False:
            raise ValueError(f"tokenize must be False (apply_chat_template returns the text; encode it with "
                             f"add_special_tokens=False), got {tokenize!r}")
        # transformers' own keywords for its tokenized output: without it they do nothing (and
        # reach no template); those that only it can honour are refused, as transformers does.
        for name in TOKENIZED_OUTPUT_ARGUMENTS:
            variables.pop(name, None)
        for name in TOKENIZED_OUTPUT_ONLY:
            if variables.pop(name, False):
                raise ValueError(f"{name}=True needs tokenize=True in transformers; apply_chat_template returns the "
                                 f"text")
        template = self.compiled_chat_template(self.get_chat_template(chat_template, tools))
        return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **variables)

    def compiled_chat_template(self, source: str) -> ChatTemplate:
        """The template `source` compiled, with this tokenizer's special tokens (kept for the
        next call); a ChatTemplateError (a ValueError) where it does not compile."""
        template = self._compiled.get(source)
        if template is None:
            template = ChatTemplate(source, self.special_tokens)
            if len(self._compiled) < 64:  # (a client's own templates are not kept without bound)
                self._compiled[source] = template
        return template


def null_stop_eos(tokenizer: Optional[Tokenizer], eos_token_ids: List[int]) -> Optional[int]:
    """Of a checkpoint's EOS ids, the one whose stop_reason is null (vLLM's: the tokenizer's;
    without one, the first): each other id that ends an output is named by its stop_reason."""
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    return eos if eos is not None else next(iter(eos_token_ids), None)
