"""Chat templates: the Jinja template a checkpoint ships, rendered the way transformers'
`apply_chat_template` renders it, so a prompt built here is byte-for-byte the prompt the
model was trained on.

Like transformers: a sandboxed environment with trim_blocks and lstrip_blocks, the
loopcontrols extension, a `tojson` filter that does not escape HTML, and the globals
`raise_exception` and `strftime_now`. The template sees `messages`,
`add_generation_prompt` and the tokenizer's special tokens (`bos_token`, `eos_token`, ...).
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import List, Mapping

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template rejected the conversation (its raise_exception), or could not render."""


def _raise_exception(message):
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        self.source = source
        self._special_tokens = dict(special_tokens)

    def render(self, messages: List[dict], add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text for a conversation; `variables` reach the template as globals
        (e.g. tools=..., or a template's own switches)."""
        try:
            # tools and documents default to None (defined), as transformers passes them.
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{"tools": None, "documents": None, **self._special_tokens, **variables})
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None
