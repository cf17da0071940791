"""Chat templates: the Jinja template a checkpoint ships, rendered the way transformers'
`apply_chat_template` renders it, so a prompt built here is byte-for-byte the prompt the
model was trained on.

Like transformers: a sandboxed environment with trim_blocks and lstrip_blocks, the
loopcontrols extension, the `{% generation %}` tag, a `tojson` filter that does not escape
HTML, the globals `raise_exception` and `strftime_now`, and `namespace` and `dict` that
cannot reach Python's internals. The template sees `messages` (as transformers passes them:
keys whose value is None dropped, reasoning under all its names), `tools`, `documents`,
`add_generation_prompt` and the tokenizer's special tokens (`bos_token`, ...); everything it
sees is rebuilt from plain JSON-like data first (a Python object's attributes stay out of
its reach: it sees "<TypeName>").
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import re
from datetime import datetime
from typing import Any, List, Mapping, Optional, Union

import jinja2
import jinja2.ext
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template rejected the conversation (its raise_exception), or could not render.
    `argument`: the render argument at fault where one is ("tools", "documents"), else None."""

    def __init__(self, message: str, argument: Optional[str] = None):
        super().__init__(message)
        self.argument = argument


def _raise_exception(message):
    raise ChatTemplateError(message)


# The characters a rendering's tojson calls may write in all (None: no limit), set by
# render_budget: tojson(indent=N) writes N x depth spaces before each item of nested data, so a
# request's tools of a few MB nested hundreds deep had rendered gigabytes before any check of the
# prompt's length could see them.
_TOJSON_BUDGET: contextvars.ContextVar[Optional[List[int]]] = contextvars.ContextVar("tojson_budget", default=None)


@contextlib.contextmanager
def render_budget(max_chars: Optional[int]):
    """Renders within the block may write at most max_chars characters of JSON (tojson) in all."""
    token = _TOJSON_BUDGET.set(None if max_chars is None else [max_chars])
    try:
        yield
    finally:
        _TOJSON_BUDGET.reset(token)


def _json_chars(x, depth: int, indent: Optional[int], item_sep: int, key_sep: int) -> int:
    """The length json.dumps gives x at `depth`, from the lengths of its pieces (without writing it);
    indent: None (one line), or the characters of one level's indentation."""
    if isinstance(x, dict):
        items = [len(json.dumps(str(k))) + key_sep + _json_chars(v, depth + 1, indent, item_sep, key_sep)
                 for k, v in x.items()]
    elif isinstance(x, (list, tuple)):
        items = [_json_chars(v, depth + 1, indent, item_sep, key_sep) for v in x]
    else:
        return len(json.dumps(x, default=str))
    if not items:
        return 2
    lines = 0 if indent is None else (1 + (depth + 1) * indent) * len(items) + 1 + depth * indent
    return 2 + sum(items) + item_sep * max(len(items) - 1, 0) + lines


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    budget = _TOJSON_BUDGET.get()
    if budget is not None:
        width = len(indent) if isinstance(indent, str) else None if indent is None else max(int(indent), 0)
        item_sep, key_sep = separators if separators is not None else ("," if indent is not None else ", ", ": ")
        chars = _json_chars(x, 0, width, len(item_sep), len(key_sep))
        if chars > budget[0]:
            raise ChatTemplateError(f"the chat template writes its data as JSON of about {chars} characters (tojson), "
                                    f"more than a prompt may have ({budget[0]} left)")
        budget[0] -= chars
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' {% generation %}...{% endgeneration %}, which marks the assistant's text for
    training masks (chat templates on the Hub use it): rendered, the body as it is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Dict:
    """The template's `dict`: builds dicts, and is not the dict type (whose attributes lead out)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """The template's `namespace`, refusing underscore names (a way to CPython's internals)."""

    def __init__(*args, **kwargs):  # (jinja2's signature: `namespace(self=...)` stays a field)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise ChatTemplateError(f"the chat template may not store the underscore name {name!r} on a namespace")


def _plain(value: Any) -> Any:
    """`value` rebuilt from JSON-like types, as transformers does before the template sees it:
    dataclasses and pydantic models as dicts, subclasses of str / int / float as the base
    type, numpy scalars as Python ones, anything else as the placeholder "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models (the openai client's messages)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


# Names a message's reasoning goes by: transformers passes it under the first two whichever was given.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What transformers appends to the final message's content to find where it ends in the text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

# Where a template renders a conversation as no text (an empty template), for the server and
# the CLI, whose engine would otherwise say only that the prompt is empty.
EMPTY_CHAT_PROMPT = "the chat template renders these messages as no text, which leaves the model no prompt"


def _template_messages(messages) -> List[dict]:
    """The messages as transformers passes them: plain data (_plain), without the keys whose
    value is None (templates test whether a key is there: {"tool_calls": None} is none), and
    reasoning under any of its names also as reasoning_content and thinking."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(_plain(list(messages))):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"message {i} must be a dict, got {type(messages[i]).__name__}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _list_of_dicts(name: str, value, what: str) -> Optional[list]:
    """tools or documents: None, or a list of dicts (plain data); `what` names one."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ChatTemplateError(f"{name} must be a list of dicts (each {what}), got {type(value).__name__}", name)
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            hint = " (a Python function is not turned into its schema here: pass the schema)" if callable(item) else ""
            raise ChatTemplateError(f"{name}[{i}] must be {what} (a dict), got {type(item).__name__}{hint}", name)
    return _plain(list(value))


def _tag_final_message(message: dict, field: str, source: str) -> str:
    """Appends _CONTINUE_TAG to the final message's text in `field` (a list's last text part),
    as transformers marks it, and returns that text."""
    text = message.get(field)
    if text is None:
        raise ChatTemplateError(f"continue_final_message: the final message has no {field!r} to continue")
    fields = [field]
    if field in _REASONING_FIELDS:  # reasoning goes under several names: tag each, whichever the template reads
        fields = [f for f in _REASONING_FIELDS if message.get(f) == text]
    if not any(f in source for f in fields):
        raise ChatTemplateError(f"continue_final_message: the chat template does not read the final message's "
                                f"{field!r}")
    if isinstance(text, (list, tuple)):
        parts = list(text)
        for i in reversed(range(len(parts))):
            if isinstance(parts[i], dict) and "text" in parts[i]:  # the last part with a text, as transformers picks
                if not isinstance(parts[i]["text"], str):
                    raise ChatTemplateError(f"continue_final_message: the final message's last text part's 'text' "
                                            f"is {type(parts[i]['text']).__name__}, not text")
                parts[i] = {**parts[i], "text": parts[i]["text"] + _CONTINUE_TAG}
                message[field] = tuple(parts) if isinstance(text, tuple) else parts  # (as the template prints it)
                return text[i]["text"]
        raise ChatTemplateError("continue_final_message: the final message has no text to continue")
    if not isinstance(text, str):
        raise ChatTemplateError(f"continue_final_message: the final message's {field!r} is not text")
    for f in fields:
        message[f] = text + _CONTINUE_TAG
    return text


def _environment() -> ImmutableSandboxedEnvironment:
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])


def _under_filters(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """An expression without the filters, tests and slices around it (`messages[1:] | reverse`)."""
    while True:
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        else:
            return node


def _reads(node: jinja2.nodes.Node, names: set, key: Optional[str] = None) -> bool:
    """Whether an expression is one of the variables `names` (its field `key`, where given:
    `message['content']` or `message.content`), filtered, tested or sliced or not."""
    node = _under_filters(node)
    if key is not None:
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) and \
                node.arg.value == key:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getattr) and node.attr == key:
            node = node.node
        else:
            return False
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names


def names_role(source: str, role: str) -> bool:
    """Whether a chat template names `role` as a quoted string outside its comments (a comment
    or prose mentioning the word had counted)."""
    code = re.sub(r"\{#.*?#\}", "", source, flags=re.S)
    return f"'{role}'" in code or f'"{role}"' in code


@functools.lru_cache(maxsize=16)
def loops_over_content(source: str) -> bool:
    """Whether a chat template loops over a message's content, as a multimodal one such as
    Gemma's does (`{% for message in messages %}...{% for part in message['content'] %}`): it
    takes content as a list of parts. vLLM gives such a template a client's text parts as a
    list, and any other the texts joined by newlines; this decides as vLLM does. The messages
    are `messages` and the variables set from it (filtered or sliced or not), a message is the
    variable of a loop over those, and its content is then looped over directly: not through
    an index (`messages[i]`), a macro's parameter or a namespace's field, where vLLM's reading
    of the template ends, saying no. A template that does not parse: no (its rendering says what
    is wrong)."""
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateError:
        return False
    lists, grown = {"messages"}, True
    while grown:
        grown = False
        for assign in tree.find_all(jinja2.nodes.Assign):
            if _reads(assign.node, lists):
                if not isinstance(assign.target, jinja2.nodes.Name):
                    return False
                grown |= assign.target.name not in lists
                lists.add(assign.target.name)
    messages = set()
    for loop in tree.find_all(jinja2.nodes.For):
        if _reads(loop.iter, lists):
            if not isinstance(loop.target, jinja2.nodes.Name):
                return False
            messages.add(loop.target.name)
    loop = next((loop for loop in tree.find_all(jinja2.nodes.For) if _reads(loop.iter, messages, "content")), None)
    return loop is not None and isinstance(loop.target, jinja2.nodes.Name)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str]):
        env = _environment()
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                           namespace=_Namespace)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        self.source = source
        self._special_tokens = dict(special_tokens)

    def render(self, messages: List[dict], add_generation_prompt: Optional[bool] = None,
               continue_final_message: Union[bool, str] = False, tools=None, documents=None,
               **variables) -> str:
        """The prompt text for a conversation; `variables` reach the template as globals
        (a template's own switches). tools (JSON schemas) and documents are lists of dicts.
        add_generation_prompt (default: True unless continue_final_message) ends the text with
        the header of a new assistant turn; continue_final_message, as in transformers, ends it
        where the final message's content does (no end of turn after it), for the model to
        continue that message; a field's name instead of True continues that field (a
        message's "reasoning_content", say)."""
        try:
            return self._render(messages, add_generation_prompt, continue_final_message, tools, documents, variables)
        except RecursionError:  # data nested deeper than Python's stack (the server's JSON parser takes more)
            raise ChatTemplateError("the messages, tools, documents or template variables nest too deeply") from None

    def _render(self, messages, add_generation_prompt, continue_final_message, tools, documents, variables) -> str:
        messages = _template_messages(messages)
        if not messages:
            raise ChatTemplateError("the conversation is empty: give at least one message")
        if not isinstance(continue_final_message, (bool, str)):
            raise ChatTemplateError(f"continue_final_message must be True, False or the name of the final message's "
                                    f"field to continue, got {continue_final_message!r}")
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        final_text = None
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt exclude each other: "
                                        "the one continues the final message, the other starts a new one")
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final_text = _tag_final_message(messages[-1], field, self.source)
        tools = _list_of_dicts("tools", tools, "a JSON schema")
        documents = _list_of_dicts("documents", documents, "a document")
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, documents=documents,
                                         **{**self._special_tokens, **_plain(variables)})
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None
        except Exception as e:  # the template's own Python errors (a number where it adds strings, ...)
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
        if final_text is not None:
            end = text.rfind(_CONTINUE_TAG.strip())
            if end < 0 or final_text.strip() not in text:
                raise ChatTemplateError("continue_final_message: the chat template does not write the final "
                                        "message's text as it is, so the prompt cannot end inside it")
            # As transformers: a template that trims the content trimmed the tag's space, and the content's.
            text = text[:end] if text.startswith(_CONTINUE_TAG, end) else text[:end].rstrip()
        return text
