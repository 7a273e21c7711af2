"""Checks on text from outside (HTTP bodies, the command line) before it reaches the tokenizer.

A Python ``str`` may hold lone surrogates (U+D800 to U+DFFF) that no UTF-8 text can: JSON's
``"\\ud800"`` escape decodes to one, and so does each byte of a command-line argument that is
not UTF-8 (``surrogateescape``). The Rust tokenizer refuses such a string with a TypeError,
and the UTF-8 encoder with a UnicodeEncodeError: they are refused here first, naming the
character and where it is.
"""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")  # a valid pair is one code point in a str


def lone_surrogate(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (its first lone surrogate), or None if it is."""
    m = _SURROGATE.search(text)
    if m is None:
        return None
    return (
        f"holds a lone surrogate U+{ord(m.group()):04X} at character {m.start()}, which is "
        "not valid Unicode (half of a UTF-16 pair, or a byte that is not UTF-8)"
    )
