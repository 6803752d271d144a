"""JSON text read within fixed limits: the one JSON reader of untrusted text in ``deploy``.

Owns :func:`loads`, :func:`nesting_depth` (of JSON text) and :func:`value_depth` (of a
value already parsed, or built in Python), and :class:`JSONLimitError`. ``json.loads`` alone fails on hostile
text in ways that are not a ``ValueError``: its C scanner recurses once per ``[`` or
``{`` (100,000 of them raise RecursionError), an integer literal of more than 4,300
digits raises from ``int()``, ``1e999`` becomes ``inf``, ``NaN`` and ``Infinity`` are
accepted, and ``"\\ud800"`` becomes a lone surrogate that no UTF-8 encoder (the
tokenizer's included) can take. Here the nesting depth is measured by a scan of the
text before the parser runs (strings blanked out, the brackets' running depth summed in
numpy), integer literals are refused past :data:`MAX_INT_DIGITS` digits, non-finite
numbers and lone surrogates are refused: every failure is a ``ValueError`` whose
message says what was refused.

Must not import: ``ray``, ``torch``, ``tokenizers``, any other ``deploy`` module,
``cluster``, ``model``, ``actors``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

# Longer than any integer the API takes (a seed modulo 2**64 has 20 digits), far
# shorter than Python's own limit on int() of a string (4,300 digits).
MAX_INT_DIGITS = 24
# A JSON string: quote, then runs of unescaped characters or escapes, then quote
# (possessive, so an unterminated string costs one pass, never backtracking).
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
# "[" and "{" as byte 2, "]" and "}" as byte 0: minus one, the depth's step.
_STEP_BYTES = str.maketrans({"[": "\x02", "{": "\x02", "]": "\x00", "}": "\x00"})


class JSONLimitError(ValueError):
    """JSON text refused by a limit or for content no client could send back;
    ``path`` is where in the value it was found, when that is known."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


def nesting_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in ``text`` (0 for a scalar), counted
    outside strings, without parsing. Text that is not JSON gets some number; the
    parser then refuses it."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    steps = np.frombuffer(brackets.translate(_STEP_BYTES).encode("ascii"), dtype=np.int8).astype(np.int64) - 1
    return int(np.cumsum(steps).max())


def value_depth(value: Any) -> int:
    """The deepest nesting of lists and dicts in ``value`` (0 for a scalar), walked
    without recursion (a value built in Python may be nested beyond the stack)."""
    deepest = 0
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, (list, tuple)):
            deepest = max(deepest, depth + 1)
            pending.extend((child, depth + 1) for child in item)
    return deepest


class _LiteralRefused(JSONLimitError):
    """A number literal refused by the parser's hooks (which do not know where it is)."""

    def __init__(self, message: str, literal: str) -> None:
        super().__init__(message)
        self.literal = literal


def _integer(literal: str) -> int:
    digits = len(literal.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _LiteralRefused(f"an integer of {digits} digits (allowed: at most {MAX_INT_DIGITS})", literal)
    return int(literal)


def _real(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _LiteralRefused(f"the number {literal[:32]} is out of range (allowed: finite numbers)", literal)
    return value


def _constant(name: str) -> Any:
    raise _LiteralRefused(f"{name} is not JSON (allowed: finite numbers)", name)


_KEY_BEFORE = re.compile(r'"((?:[^"\\]|\\.)*)"\s*:\s*\Z')


def _key_of(text: str, literal: str) -> str | None:
    """The object key whose value is the first ``literal`` outside strings, if any."""
    blanked = _STRING.sub(lambda string: "'" * len(string.group()), text)
    found = re.search(rf"(?<![\w.+-]){re.escape(literal)}(?![\w.])", blanked)
    if found is None:
        return None
    key = _KEY_BEFORE.search(text, max(0, found.start() - 4096), found.start())
    return None if key is None else key.group(1)


def _lone_surrogate(value: Any, path: str) -> tuple[str, str] | None:
    """(path, what) of the first string holding a lone surrogate: a value at ``path``
    or a key of the object at ``path``."""
    if isinstance(value, str):
        return (path, "a lone UTF-16 surrogate") if _SURROGATE.search(value) else None
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, f"{path}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            if _SURROGATE.search(key):
                return path, "a key holding a lone UTF-16 surrogate"
            found = _lone_surrogate(item, f"{path}.{key}" if path else key)
            if found is not None:
                return found
    return None


def loads(text: str, *, max_depth: int) -> Any:
    """``json.loads(text)`` within the limits (see the module docstring); raises
    ValueError (``json.JSONDecodeError`` for a syntax error, :class:`JSONLimitError`
    for a limit) naming what was refused. The depth check is linear in the text and
    runs first, so the parser never recurses deeper than ``max_depth``."""
    depth = nesting_depth(text)
    if depth > max_depth:
        raise JSONLimitError(f"nested {depth} levels deep (allowed: at most {max_depth})")
    try:
        value = json.loads(text, parse_int=_integer, parse_float=_real, parse_constant=_constant)
    except _LiteralRefused as refused:
        key = _key_of(text, refused.literal)
        raise JSONLimitError(str(refused) if key is None else f"{key}: {refused}", key) from None
    # A lone surrogate arrives only through a \\u escape (or is in the text already).
    if _SURROGATE_ESCAPE.search(text) or _SURROGATE.search(text):
        found = _lone_surrogate(value, "")
        if found is not None:
            path, what = found
            raise JSONLimitError(f"{path or 'the value'}: {what} (allowed: valid Unicode text)", path or None)
    return value
