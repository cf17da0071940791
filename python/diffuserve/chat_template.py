"""Chat templates: the Jinja template a checkpoint ships, rendered the way transformers'
`apply_chat_template` renders it, so a prompt built here is byte-for-byte the prompt the
model was trained on.

Like transformers: a sandboxed environment with trim_blocks and lstrip_blocks, the
loopcontrols extension, the `{% generation %}` tag, a `tojson` filter that does not escape
HTML, and the globals `raise_exception` and `strftime_now`. The template sees `messages`
(as transformers passes them: keys whose value is None dropped, reasoning under all its
names), `add_generation_prompt` and the tokenizer's special tokens (`bos_token`, ...).
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import List, Mapping, Optional

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ._checks import check_bool


class ChatTemplateError(ValueError):
    """The template rejected the conversation (its raise_exception), or could not render."""


def _raise_exception(message):
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
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


# Names a message's reasoning goes by: transformers passes it under the first two whichever was given.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What transformers appends to the final message's content to find where it ends in the text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _template_messages(messages: List[dict]) -> List[dict]:
    """Copies of the messages as transformers passes them: without the keys whose value is None
    (templates test whether a key is there: {"tool_calls": None} is none), and reasoning under
    any of its names also as reasoning_content and thinking."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {i} must be a dict, got {type(message).__name__}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tagged(content):
    """A final message's content with _CONTINUE_TAG after its text (a list's last text part),
    as transformers marks it; None when it has no text."""
    if isinstance(content, str):
        return content + _CONTINUE_TAG
    if isinstance(content, list):
        for i in reversed(range(len(content))):
            part = content[i]
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                return content[:i] + [{**part, "text": part["text"] + _CONTINUE_TAG}] + content[i + 1:]
    return None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        self.source = source
        self._special_tokens = dict(special_tokens)

    def render(self, messages: List[dict], add_generation_prompt: Optional[bool] = None,
               continue_final_message: bool = False, **variables) -> str:
        """The prompt text for a conversation; `variables` reach the template as globals
        (e.g. tools=..., or a template's own switches). add_generation_prompt (default: True
        unless continue_final_message) ends the text with the header of a new assistant turn;
        continue_final_message, as in transformers, ends it where the final message's content
        does (no end of turn after it), for the model to continue that message."""
        messages = _template_messages(messages)
        if not messages:
            raise ChatTemplateError("the conversation is empty: give at least one message")
        continue_final_message = check_bool("continue_final_message", continue_final_message)
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt exclude each other: "
                                        "the one continues the final message, the other starts a new one")
            messages[-1]["content"] = _tagged(messages[-1].get("content"))
            if messages[-1]["content"] is None:
                raise ChatTemplateError("continue_final_message: the final message has no text to continue")
        try:
            # tools and documents default to None (defined), as transformers passes them.
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{"tools": None, "documents": None, **self._special_tokens, **variables})
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None
        if continue_final_message:
            end = text.rfind(_CONTINUE_TAG.strip())
            if end < 0:
                raise ChatTemplateError("continue_final_message: the chat template does not write the final "
                                        "message's content")
            # As transformers: a template that trims the content trimmed the tag's space, and the content's.
            text = text[:end] if text.startswith(_CONTINUE_TAG, end) else text[:end].rstrip()
        return text
