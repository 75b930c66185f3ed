"""Tests of tf_sparse_split.utils.validation (pure Python)."""

import math

import numpy as np
import pytest

from tf_sparse_split.utils.validation import (AUTO_THRESHOLD,
                                              threshold_from_text,
                                              validate_fraction, validate_int,
                                              validate_positive_float,
                                              validate_threshold)


@pytest.mark.parametrize("value, expected", [
    (0, 0.0), (1, 1.0), (0.25, 0.25), (np.float32(0.5), 0.5),
    (np.float64(0.125), 0.125), (-1, -1.0), (-0.5, -0.5), (-math.inf, -math.inf),
    ("auto", AUTO_THRESHOLD), (" AUTO ", -1.0), (np.str_("Auto"), -1.0),
])
def test_threshold_accepts(value, expected):
    assert validate_threshold(value) == expected


@pytest.mark.parametrize("value", [1.5, math.inf, math.nan, np.float32("nan"),
                                   "abc", "", "0.75", "-1", b"auto", None,
                                   True, [0.5], np.bool_(False)])
def test_threshold_refuses_with_keras_style_message(value):
    with pytest.raises(ValueError, match=r"must be a number in \[0, 1\], or "
                                         r"'auto' or a negative number for "
                                         r"automatic\. Received: threshold="):
        validate_threshold(value)


def test_threshold_names_the_argument():
    with pytest.raises(ValueError, match=r"`t` must .* Received: t='fast'"):
        validate_threshold("fast", "t")


@pytest.mark.parametrize("text, expected", [
    ("auto", -1.0), ("AUTO", -1.0), ("0.5", 0.5), ("1", 1.0), ("0", 0.0),
    ("-1", -1.0), ("-0.25", -0.25), ("1e-2", 0.01)])
def test_threshold_from_text(text, expected):
    assert threshold_from_text(text) == expected


@pytest.mark.parametrize("text", ["fast", "", "nan", "1.5", "inf", "0,5"])
def test_threshold_from_text_refuses(text):
    with pytest.raises(ValueError, match=r"Received: threshold="):
        threshold_from_text(text)


def test_fraction():
    assert validate_fraction(0, "rate") == 0.0
    assert validate_fraction("0.5", "rate") == 0.5
    for bad in (1.0, -0.1, math.nan, "x", True):
        with pytest.raises(ValueError, match=r"`rate` must be a number in "
                                             r"\[0, 1\)\. Received: rate="):
            validate_fraction(bad, "rate")
    assert validate_fraction(1.0, "f", high_inclusive=True) == 1.0
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        validate_fraction(0.0, "f", low_inclusive=False)


def test_int():
    assert validate_int(3, "n") == 3
    assert validate_int(np.int64(0), "n", 0) == 0
    for bad in (0, -2, 1.0, "3", True, None):
        with pytest.raises(ValueError, match=r"Received: n="):
            validate_int(bad, "n")


def test_positive_float():
    assert validate_positive_float("1e-3", "lr") == 1e-3
    for bad in (0, -1.0, math.nan, "x", False):
        with pytest.raises(ValueError, match=r"`lr` must be a number > 0"):
            validate_positive_float(bad, "lr")
