"""Field types that the request bodies of both APIs share (``schemas``, ``openai_schemas``).

``Text`` is a string that must be valid Unicode: JSON can carry lone surrogates (``"\\ud800"``)
that the tokenizer refuses with a TypeError, which would be a 500. Pydantic reports the field's
location, so the 422 (TGI) or 400 (OpenAI, with ``param``) names it. ``UnicodeChecked`` applies
the same check to a union (``str | list[str]``) as a whole, so that its error comes once, at
the field, rather than once per member of the union.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

from flashserve.tokenizer.text_checks import lone_surrogate

T = TypeVar("T")


def unicode_text(value: T) -> T:
    """``value`` unchanged when every string in it (it, or its items when it is a list) is
    valid Unicode; otherwise a validation error, e.g. ``item 1 holds a lone surrogate...``."""
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    for i, item in enumerate(items):
        if isinstance(item, str) and (why := lone_surrogate(item)):
            where = "" if isinstance(value, str) else f"item {i} "
            raise PydanticCustomError("unicode", where + why)
    return value


UnicodeChecked = AfterValidator(unicode_text)
Text = Annotated[str, UnicodeChecked]


def sent_or(value: T | None, default: T) -> T:
    """The value the client sent, else ``default``: ``value or default`` would also replace a
    0 that was sent (``repetition_penalty: 0`` served as 1.0), which must be refused or served
    as sent."""
    return default if value is None else value
