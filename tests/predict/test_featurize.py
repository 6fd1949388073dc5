"""Prompt featurisation: hand cases of the tokenizer and prompt statistics."""

from __future__ import annotations

import math

from olproute.predict import STAT_NAMES, Featurizer


def test_a_superscript_digit_is_not_a_requested_length() -> None:
    # "2²".isdigit() holds but float("2²") raises: the number rule must not read it
    def requested_words(text: str) -> float:
        stats = Featurizer().stats_and_hashed(text)[0]
        return dict(zip(STAT_NAMES, stats, strict=True))["log_requested_words"]

    assert requested_words("Give 2² words.") == 0.0
    assert requested_words("What is 2², in 3 words?") == math.log1p(3)
