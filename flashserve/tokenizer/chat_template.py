"""Rendering a model's Jinja chat template, the way Hugging Face tokenizers do.

Templates come with model files, so they are untrusted code: they run in Jinja's immutable
sandbox. The environment matches the one templates are written against: ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII
text, and the globals ``raise_exception`` and ``strftime_now``.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text in some templates;
    rendering keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once (cached by its text)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def check_messages(messages: Any) -> None:
    """Raise ValueError unless ``messages`` is a list of ``{"role": str, "content": str}``."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                got = type(msg[key]).__name__ if key in msg else "nothing"
                raise ValueError(f"messages[{i}]['{key}'] must be a string, got {got}")


def render_chat(source: str | None, messages: list[dict], **variables: Any) -> str:
    """Check ``messages`` and render them with the template ``source``.

    ``variables`` become template variables (``add_generation_prompt``, ``bos_token``, tools...).
    Raises ValueError when there is no template, the messages are malformed, or the template
    itself rejects them (``raise_exception``) or fails to render.
    """
    if not source:
        raise ValueError("this model has no chat template; send a plain prompt instead")
    check_messages(messages)
    try:
        return compile_template(source).render(messages=messages, **variables)
    except jinja2.exceptions.TemplateError as err:
        raise ValueError(f"chat template error: {err}") from err
