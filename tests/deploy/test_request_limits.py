"""The limits a request is read within, without a server: deploy.safe_json against the
standard parser (the same value for every JSON text inside the limits, a clean
ValueError naming what was refused for every text outside them, in time linear in the
text), the request body's reading (413, UTF-8, the field named), the API key check, the
JSON content types, and the application arguments that configure them."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.deploy import safe_json
from dsv41.deploy.app import _is_json
from dsv41.deploy.app_args import AppArgs
from dsv41.deploy.openai_api import RequestLimits, parse_body
from dsv41.deploy.openai_errors import OpenAIError, bearer_matches

_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**safe_json.MAX_INT_DIGITS - 1), 10**safe_json.MAX_INT_DIGITS - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=("Cs",))),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(st.characters(exclude_categories=("Cs",))), inner, max_size=4),
    max_leaves=24,
)


@settings(max_examples=200, deadline=None)
@given(value=_JSON, indent=st.none() | st.integers(0, 2), ascii=st.booleans())
def test_within_the_limits_it_is_the_standard_parser(value: Any, indent: int | None, ascii: bool) -> None:
    """Any JSON text whose depth is within the limit parses to what json.loads gives;
    the depth scan of the text equals the parsed value's depth."""
    text = json.dumps(value, indent=indent, ensure_ascii=ascii)
    depth = safe_json.value_depth(value)
    assert safe_json.nesting_depth(text) == depth
    assert safe_json.loads(text, max_depth=max(depth, 1)) == json.loads(text)
    if depth > 1:
        with pytest.raises(safe_json.JSONLimitError, match=f"nested {depth} levels"):
            safe_json.loads(text, max_depth=depth - 1)


HOSTILE = [
    ("100,000 [", "[" * 100_000, "nested 100000 levels deep"),
    ("100,000 [] pairs nested", "[" * 100_000 + "]" * 100_000, "nested 100000 levels deep"),
    ("5,000 {", '{"a":' * 5000 + "1" + "}" * 5000, "nested 5000 levels deep"),
    ("brackets inside strings do not count, an open one does", '["[[[[", [[', "not valid JSON|Expecting"),
    ("5,000 digits", '{"max_tokens": ' + "9" * 5000 + "}", "max_tokens: an integer of 5000 digits"),
    ("1e999", '{"t": 1e999}', "t: the number 1e999 is out of range"),
    ("NaN", '{"t": NaN}', "t: NaN is not JSON"),
    ("-Infinity in a list", "[1, -Infinity]", "-Infinity is not JSON"),
    ("a lone high surrogate", '{"p": ["ok", "\\ud800"]}', r"p\[1\]: a lone UTF-16 surrogate"),
    ("a lone low surrogate in a key", '{"m": {"\\udc00": 1}}', "m: a key holding a lone UTF-16 surrogate"),
    ("4 MB of quotes", '"' * (4 << 20), "Extra data"),
    ("4 MB of backslashes", '"' + "\\" * (4 << 20), "Unterminated string"),
]


@pytest.mark.parametrize(("text", "refusal"), [case[1:] for case in HOSTILE], ids=[case[0] for case in HOSTILE])
def test_outside_the_limits_it_refuses_fast_with_a_value_error(text: str, refusal: str) -> None:
    """Text no server should parse is refused with a ValueError saying why, fast (tens
    of milliseconds on an idle core; the bound leaves room for a loaded CI box), never
    reaching the parser's recursion or int()'s own limit."""
    start = time.monotonic()
    with pytest.raises(ValueError, match=refusal):
        safe_json.loads(text, max_depth=64)
    assert time.monotonic() - start < 5.0


def test_a_surrogate_pair_is_text() -> None:
    """Escaped surrogates that pair up are one character, accepted."""
    assert safe_json.loads('{"p": "\\ud83d\\ude00"}', max_depth=4) == {"p": "\U0001f600"}


def test_value_depth_walks_without_recursion() -> None:
    """A Python value nested far beyond the stack still has its depth measured."""
    value: Any = 1
    for _ in range(20_000):
        value = [value]
    assert safe_json.value_depth(value) == 20_000


def test_a_body_is_read_within_its_limits() -> None:
    """Past max_body_bytes a body is a 413; a body that is not UTF-8, not JSON or not
    an object is a 400; a refused literal or string names the top-level field."""
    limits = RequestLimits(max_body_bytes=64, max_json_depth=4, max_schema_depth=2)
    assert parse_body(b'{"prompt": "hi"}', limits) == {"prompt": "hi"}
    cases = [
        (b'{"prompt": "' + b"x" * 64 + b'"}', 413, None),
        (b'{"prompt": "\xff"}', 400, None),
        (b"[1]", 400, None),
        (b'{"a": [[[[1]]]]}', 400, None),
        (b'{"max_tokens": 1' + b"0" * 30 + b"}", 400, "max_tokens"),
        (b'{"messages": [{"content": "\\udfff"}]}', 400, "messages"),
    ]
    for raw, status, param in cases:
        with pytest.raises(OpenAIError) as refused:
            parse_body(raw, limits)
        assert (refused.value.status, refused.value.param) == (status, param), raw


@given(key=st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1), header=st.text(max_size=40))
def test_only_bearer_and_the_exact_key_authorize(key: str, header: str) -> None:
    """``Bearer KEY`` (scheme in any case) matches; anything else does not."""
    assert bearer_matches(f"Bearer {key}", key) and bearer_matches(f"bearer {key}", key)
    assert not bearer_matches(None, key) and not bearer_matches(key, key) and not bearer_matches(f"Basic {key}", key)
    assert bearer_matches(header, key) == (header.strip().lower().startswith("bearer ") and header.strip()[7:].strip() == key)


@pytest.mark.parametrize(
    ("content_type", "accepted"),
    [
        ("application/json", True),
        ("application/json; charset=utf-8", True),
        ('APPLICATION/JSON; Charset="UTF-8"', True),
        (None, False),
        ("text/plain", False),
        ("text/plain; charset=utf-8", False),
        ("application/x-www-form-urlencoded", False),
        ("multipart/form-data; boundary=x", False),
        ("application/json; charset=utf-16", False),
        ("application/json-seq", False),
    ],
)
def test_only_json_content_types_are_read(content_type: str | None, accepted: bool) -> None:
    """A body is read as JSON only when declared application/json, UTF-8 if a charset
    is named."""
    assert _is_json(content_type) is accepted


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"api_key": ""}, "api_key"),
        ({"public_routes": ["/v1/models"]}, "public_routes"),
        ({"grpc_port": 70000}, "grpc_port"),
        ({"grpc_host": ""}, "grpc_host"),
        ({"limits": {"max_tools": 0}}, "limits.max_tools"),
        ({"limits": {"max_schema_depth": 64}}, "limits.max_schema_depth"),
        ({"limits": {"max_depth": 3}}, "limits: unknown"),
        ({"engine": {"long_prefill_token_threshold": -1}}, "long_prefill_token_threshold"),
    ],
)
def test_bad_application_arguments_are_refused(args: dict[str, Any], field: str) -> None:
    """Each exposure and limit argument is checked when the application is built, the
    refusal naming it."""
    with pytest.raises(ValueError, match=field):
        AppArgs.from_dict(args)


def test_the_api_key_is_not_shown() -> None:
    """The key reaches the ingress but never a repr (logs, Serve's error messages)."""
    args = AppArgs.from_dict({"api_key": "s3cret-key", "grpc_port": 0})
    assert args.ingress_options().api_key == "s3cret-key"
    assert "s3cret-key" not in repr(args) and "s3cret-key" not in repr(args.ingress_options())
    assert math.isfinite(args.request_limits().max_body_bytes)
