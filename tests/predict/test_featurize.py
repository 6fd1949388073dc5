"""Prompt featurisation: the compiled kernel (``olproute.predict._featurize``) against its
plain-Python twin (``Featurizer(compiled=False)``), bitwise, on hand cases and on random
ASCII and Unicode text; the kernel's tokens against the regex over every code point; its
crc32 against zlib's; and the predictor's request path on the compiled kernel."""

from __future__ import annotations

import math
import re
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olproute.predict import (
    STAT_NAMES,
    Featurizer,
    TrainConfig,
    _featurize,
    tokenize,
    train_and_evaluate,
)
from olproute.predict import features as F
from olproute.sim.prompts import generate_prompts, training_data

TWINS = {d: (Featurizer(d), Featurizer(d, compiled=False)) for d in (512, 100, 7, 1)}


def assert_twins_agree(text: str, num_dims: int = 512) -> None:
    compiled, python = TWINS[num_dims]
    stats_c, hashed_c = compiled.stats_and_hashed(text)
    stats_p, hashed_p = python.stats_and_hashed(text)
    assert hashed_c.dtype == hashed_p.dtype == np.float64
    assert hashed_c.tobytes() == hashed_p.tobytes()  # bitwise, signed zeros included
    assert [s.hex() for s in stats_c] == [s.hex() for s in stats_p]


def stat(text: str, name: str) -> float:
    return Featurizer().stats_and_hashed(text)[0][STAT_NAMES.index(name)]


HAND_CASES = [
    "", " ", "\n\n\t \r\x0b\x0c", "...", "?!?", "-", "_", "__init__", "Answer in 3 sentences.",
    "Write a 250-word essay.", "Write a 250 - word essay.", "3 very short words",
    "3 a very short words", "Give me five tips, then 10 ideas.",
    "3 short, concise words", "list 3 of the 4 reasons", "0 words", "zero words", "007 words",
    "1_000 words", "3.5 words", "in 12 paragraphs\nand twenty items", "line one\nline two\n",
    "Summarize the key findings of the text below, briefly.", "How does it work? Why?",
    "Step by step, in detail, compare A vs B.", "[WP] a story in 500 words",
    "9" * 400 + " words",  # float() of the token is inf: both say so
    "What is 2² in 3 words?", "١٢ words and ３ sentences",  # Unicode decimals are numbers
    "ÉCRIS EN 3 PHRASES. İstanbul, ΣΑΣ, Straße", "café — “quoted” … naïve ①②",
    "emoji 🙂🙂 words 🙂", "tab\tsep\x1cfile\x1dgroup\x00nul", "a\u00a0b\u2028c\u3000d",
    " ".join(["the cat sat"] * 200) + " in 3 sentences",  # a window of first and last 80
]


@pytest.mark.parametrize("text", HAND_CASES)
def test_compiled_matches_the_python_twin_on_hand_cases(text: str) -> None:
    for num_dims in TWINS:
        assert_twins_agree(text, num_dims)


@pytest.mark.parametrize(("text", "name", "value"), [
    ("", "log_tokens", 0.0),
    ("...", "log_sentences", math.log1p(3)),
    ("Answer in 3 sentences.", "log_requested_sentences", math.log1p(3)),
    ("Write a 250-word essay.", "log_requested_words", math.log1p(250)),
    ("line one\nline two\n", "log_newlines", math.log1p(2)),
    ("١٢ words", "log_requested_words", math.log1p(12)),
    ("Give 2² words.", "log_requested_words", 0.0),  # "2²".isdigit(), but float() refuses it
    ("What is 2², in 3 words?", "log_requested_words", math.log1p(3)),
])
def test_hand_cases_read_what_they_say(text: str, name: str, value: float) -> None:
    assert stat(text, name) == value


def test_the_request_path_featurizer_is_compiled() -> None:
    assert Featurizer().compiled and not Featurizer(compiled=False).compiled


# Text built from the words the rules look up, numbers, punctuation and Unicode, and from
# phrases of a number, up to four other tokens and a unit, so that random prompts set
# indicators and requested lengths, not only hash tokens.
_VOCAB = sorted({*F._NUMBERS, *F._UNITS, *(w for _, ws in F._INDICATOR_WORDS for g in ws
                                             for w in g.split())})
_GRAMS = sorted(g for _, ws in F._INDICATOR_WORDS for g in ws)
_NUMBER = st.one_of(st.sampled_from(sorted(F._NUMBERS)), st.integers(0, 10**4).map(str),
                    st.sampled_from(["١٢", "2²", "０7", "1_0", "3.5"]))
_FILLER = st.sampled_from(["very", "short", "-", ",", "about", "3", "five", "x_y", "é", "²"])
_PHRASE = st.tuples(_NUMBER, st.lists(_FILLER, max_size=4), st.sampled_from(sorted(F._UNITS)),
                    ).map(lambda t: " ".join([t[0], *t[1], t[2]]))
_WORDS = st.one_of(
    st.sampled_from(_VOCAB), st.sampled_from(_GRAMS).map(str.upper), _PHRASE, _PHRASE,
    st.integers(0, 10**6).map(str), st.sampled_from(list(".,;:!?-_'\"()[]/")),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=6),
    st.text(st.sampled_from("abcXYZ019_-.²١٣ÉéİΣßſﬁ🙂"), min_size=1, max_size=8))
_SEPS = st.sampled_from([" ", " ", " ", "", "\n", "\t", "  ", "\u00a0", "-", " - ", "\x1c"])


@st.composite
def prompts(draw: st.DrawFn, max_words: int) -> str:
    words = draw(st.lists(_WORDS, max_size=max_words))
    return "".join(w + draw(_SEPS) for w in words)


@settings(max_examples=400, derandomize=True)
@given(text=prompts(40), num_dims=st.sampled_from(sorted(TWINS)))
def test_compiled_matches_the_python_twin_on_random_prompts(text: str, num_dims: int) -> None:
    assert_twins_agree(text, num_dims)


@settings(max_examples=60, derandomize=True)
@given(text=prompts(400))
def test_compiled_matches_the_python_twin_past_the_window(text: str) -> None:
    assert_twins_agree(text)


@settings(max_examples=300, derandomize=True)
@given(text=st.text(st.characters(codec="utf-8"), max_size=60))
def test_compiled_matches_the_python_twin_on_any_unicode(text: str) -> None:
    assert_twins_agree(text)


def test_compiled_matches_the_python_twin_on_synthetic_prompts() -> None:
    for p in generate_prompts(120, ("qwen3-8b",), np.random.default_rng(3)):
        assert_twins_agree(p.text)


def test_compiled_matches_the_python_twin_at_the_window_edges() -> None:
    # a unigram, a bigram and constraints placed at each edge of the first and the last
    # 80 tokens, for prompts just under, at and over two windows
    phrases = ["list", "key findings", "3 words", "3 very short words", "3 a b c words"]
    for num_tokens in range(150, 172):
        for at in {0, 1, 76, 77, 78, 79, 80, 81, num_tokens - 82, num_tokens - 81,
                   num_tokens - 80, num_tokens - 79, num_tokens - 78, num_tokens - 1}:
            for phrase in phrases:
                filler = ["the"] * num_tokens
                filler[at:at + len(phrase.split())] = phrase.split()
                assert_twins_agree(" ".join(filler[:num_tokens]))


def test_kernel_tokens_match_the_regex_on_every_code_point() -> None:
    # each code point between two letters: one token if it is \w, three if it is another
    # token, two if it is \s (surrogates cannot be UTF-8 and are left out)
    kernel, hashed = F.new_kernel(), np.empty(F.NUM_HASH_DIMS)
    points = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    for i in range(0, len(points), 8192):
        lowered = " ".join(f"a{c}b" for c in points[i:i + 8192]).lower()
        tokens = tokenize(lowered)
        num_tokens, num_chars, *_ = kernel.run(lowered, hashed)
        assert (num_tokens, num_chars) == (len(tokens), sum(map(len, tokens))), i


def test_ascii_classes_are_the_regex_classes() -> None:
    classes = F._ascii_classes()
    for i in range(128):
        c = chr(i)
        expected = (_featurize.WORD if re.fullmatch(r"\w", c) else
                    _featurize.SPACE if re.fullmatch(r"\s", c) else _featurize.OTHER)
        assert classes[i] == expected, repr(c)
        assert c.lower() == (c.lower() if "A" <= c <= "Z" else c)


@settings(max_examples=300, derandomize=True)
@given(data=st.binary(max_size=64))
def test_kernel_crc32_is_zlibs(data: bytes) -> None:
    assert _featurize.crc32(data) == zlib.crc32(data)


def test_a_lone_surrogate_counts_as_the_replacement_character() -> None:
    """A JSON body may carry a lone surrogate ("\\ud800"), which has no UTF-8 form: both
    featurisers read it as U+FFFD (a request's prediction must not fail on it)."""
    for text in ("a \ud800 b", "\udfff", "x\ud83d", "\ud83d\ude00"):
        replaced = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)
        assert_twins_agree(text)
        for featurizer in TWINS[512]:
            got, want = featurizer.stats_and_hashed(text), featurizer.stats_and_hashed(replaced)
            assert got[0] == want[0] and got[1].tobytes() == want[1].tobytes()


def test_predictions_on_the_compiled_path_equal_those_on_the_twin() -> None:
    models = ("qwen3-0.6b", "qwen3-8b")
    data = training_data(generate_prompts(240, models, np.random.default_rng(5)))
    predictor, _ = train_and_evaluate(data, {}, 0.25, TrainConfig(num_threads=1, seed=0))
    twin = Featurizer(compiled=False)
    for p in generate_prompts(20, models, np.random.default_rng(6)):
        stats, hashed = twin.stats_and_hashed(p.text)
        twin_features = np.concatenate([np.asarray(stats), predictor.pca.project(hashed)])
        assert predictor.prompt_features(p.text).tobytes() == twin_features.tobytes()
        pred = predictor.predict(p.text, models)
        decode, quality, _ = predictor.predict_matrix(
            predictor.rows(twin_features, predictor.model_ids(models)))
        assert pred.decode_tokens == tuple(np.maximum(decode, 1.0).tolist())
        assert pred.quality == tuple(quality.tolist())
