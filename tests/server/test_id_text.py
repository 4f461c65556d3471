"""What text is an id: one parser (``parse_id``) for ``snowflake decode`` and the HTTP
API's ``/v1/decode``, whose refusals name the real reason."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from snowflake_server._cli import main
from snowflake_server._errors import ConfigurationError
from snowflake_server._ids.layouts import MAX_ID, parse_id

_DIGITS = "0123456789"


def _law(text: str) -> str | None:
    """The reason ``text`` is refused, by the rule stated apart from the code; None: an id."""
    if text == "":
        return "empty"
    if text[0] == "-" and text[1:] and set(text[1:]) <= set(_DIGITS) and text[1:].strip("0"):
        return "negative"
    if not set(text) <= set(_DIGITS):
        return "not a plain decimal integer"
    return "too large" if int(text) > MAX_ID else None


def _check(text: str) -> None:
    reason = _law(text)
    if reason is None:
        assert parse_id(text) == int(text)
        return
    with pytest.raises(ConfigurationError) as refused:
        parse_id(text)
    assert str(refused.value).startswith(reason), (text, str(refused.value))


_NEAR_BOUNDS = st.sampled_from([0, 1, MAX_ID - 1, MAX_ID, MAX_ID + 1, 2**64, 10**30])
_NUMBERS = st.one_of(_NEAR_BOUNDS, st.integers(min_value=-(2**70), max_value=2**70))


@given(_NUMBERS, st.sampled_from(["", "-", "+", "0", "00"]))
@example(MAX_ID, "")
@example(MAX_ID + 1, "")
@example(1, "-")
@example(0, "-")
def test_every_decimal_in_range_is_an_id_and_every_other_is_refused_why(
    number: int, prefix: str
) -> None:
    _check(f"{prefix}{abs(number)}")


@given(
    st.text(alphabet=st.sampled_from([*_DIGITS, "-", "+", "_", " ", "\u0665", "a"]), max_size=25)
)
def test_any_text_is_an_id_exactly_when_the_law_says(text: str) -> None:
    _check(text)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("-1", "negative (ids are 0 .. 2^63-1 = 9223372036854775807)"),
        (str(2**63), "too large (ids are 0 .. 2^63-1 = 9223372036854775807)"),
        ("9" * 5000, "too large"),  # int() would refuse over 4,300 digits: never called
        ("+5", "not a plain decimal integer"),
        ("1_0", "not a plain decimal integer"),
        (" 5", "not a plain decimal integer"),
        ("\u0665", "not a plain decimal integer"),  # Arabic-Indic five: int() takes it
        ("-0", "not a plain decimal integer"),
        ("", "empty"),
    ],
)
def test_decode_names_the_reason(
    text: str, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["decode", "--", text]) == 2
    assert f"{text!r} is not an id: {reason}" in capsys.readouterr().err


def test_decode_takes_the_boundaries(capsys: pytest.CaptureFixture[str]) -> None:
    # Thousands of leading zeros: past int()'s 4,300 digits, still the id (was a ValueError:
    # a traceback here, a 500 from /v1/decode).
    padded = "0" * 5000 + str(MAX_ID)
    assert main(["decode", "--json", "0", str(MAX_ID), "000" + str(MAX_ID), padded]) == 0
    decoded = json.loads(capsys.readouterr().out)
    assert [d["id"] for d in decoded] == ["0", str(MAX_ID), str(MAX_ID), str(MAX_ID)]
