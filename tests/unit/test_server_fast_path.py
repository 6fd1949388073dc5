"""The request path's fast pieces against the slow ones they replaced: orjson's reading
of a body (json.loads' verdict and message wherever they could differ), the SSE token
count over chunks cut anywhere, the vLLM gauge reader against prometheus_client's parser,
the loop-lag summary, and an explanation's JSON rows against the element-by-element
rule."""

from __future__ import annotations

import json

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from olproute.pricing.reward import RESOURCES
from olproute.server.app import PREFIX_COUNTERS, PREFIX_QUERIES, VLLM_GAUGES, vllm_gauges
from olproute.server.looplag import LoopLag
from olproute.server.metrics import ServerMetrics
from olproute.server.proxy import _tokens_in, _tokens_in_chunk
from olproute.server.schema import (
    BadRequest,
    CompletionBody,
    dump_json,
    explanation_doc,
    parse_json,
    validate,
)

# (body, the field at fault, the message) as the router answered before orjson
REFUSED = [
    (b'{"prompt": "hi", "max_tokens": NaN}', "", "body is not valid JSON: NaN is not JSON"),
    (b'{"prompt": "hi", "max_tokens": Infinity}', "",
     "body is not valid JSON: Infinity is not JSON"),
    (b'{"prompt": "hi", "max_tokens": 123456789012345678901234567890}', "max_tokens",
     "max_tokens: must be <= 1000000"),
    (b'{"prompt": "hi", "max_tokens": 12345678901234567890.0}', "max_tokens",
     "max_tokens: input should be a valid integer, got 1.2345678901234567e+19"),
    (b'{"prompt": "hi",', "", "body is not valid JSON: Expecting property name enclosed in "
     "double quotes: line 1 column 17 (char 16)"),
    (b'{"prompt": "hi"} x', "", "body is not valid JSON: Extra data: line 1 column 18 "
     "(char 17)"),
    (b'{"prompt": "\xff"}', "", "body is not valid JSON: not UTF-8 text"),
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "",
     "body is not valid JSON: an integer has too many digits"),
    (b"[" * 70 + b"]" * 70, "", "body is nested deeper than 64 levels"),
    (b'{"prompt": "hi", "x": ' + b"[" * 65 + b"]" * 65 + b"}", "",
     "body is nested deeper than 64 levels"),
    (b"[1, 2]", "", "body must be a JSON object"),
    (b'{"prompt": "hi", "max_tokens": 5.0}', "max_tokens",
     "max_tokens: input should be a valid integer, got 5.0"),
    (b'{"prompt": "hi", "stream": 1}', "stream", "stream: input should be a valid boolean, "
     "got 1"),
]


@pytest.mark.parametrize(("raw", "field", "message"), REFUSED)
def test_refused_bodies_keep_their_messages(raw: bytes, field: str, message: str) -> None:
    with pytest.raises(BadRequest) as info:
        validate(CompletionBody, parse_json(raw))
    assert (info.value.field, str(info.value)) == (field, message)


# bodies orjson refuses or might read otherwise, and json.loads takes
ACCEPTED = [
    b'{"prompt": "\\ud800 lone surrogate"}',
    '{"prompt": "UTF-16, with its byte-order mark"}'.encode("utf-16"),
    b'\xef\xbb\xbf{"prompt": "UTF-8 with a byte-order mark"}',
    b'{"prompt": "x", "max_tokens": 9223372036854775807, "big": 18446744073709551616}',
    b'{"prompt": "x", "t": 1e400, "u": -0.0, "v": 1.5e-320}',
    b'{"prompt": "x", "prompt": "the last one wins"}',
    b'{"prompt": [1, 2, 3], "nested": {"a": [{"b": null}]}, "s": "\\u00e9\\n"}',
]


@pytest.mark.parametrize("raw", ACCEPTED)
def test_accepted_bodies_read_as_json_loads_reads_them(raw: bytes) -> None:
    data = parse_json(raw)
    expected = json.loads(raw)
    assert data == expected
    assert [type(v) for v in data.values()] == [type(v) for v in expected.values()]
    assert json.loads(dump_json(data)) == expected   # forwarded to the backend as read


SSE = (b'data: {"choices": [{"index": 0, "text": "tok "}]}\n\n'
       b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
       b'data: {"choices": [{"index": 0, "text": ""}]}\n\n'
       b": a comment\n\n"
       b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
       b'data: {"choices": [{"index": 0, "text": "last"}]}\n\n'
       b"data: [DONE]\n\n")


@pytest.mark.parametrize("cut", range(len(SSE) + 1))
def test_tokens_counted_over_chunks_cut_anywhere(cut: int) -> None:
    n1, pending = _tokens_in_chunk(b"", SSE[:cut])
    n2, pending = _tokens_in_chunk(pending, SSE[cut:])
    assert n1 + n2 + _tokens_in(pending) == 3
    assert _tokens_in_chunk(b"", SSE[:-1]) == (3, b"")


PAGE = """# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a",engine="0"} 3.0
vllm:num_requests_running{model_name="b}",engine="1"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting 7.0 1700000000000
# TYPE vllm:num_requests_waiting_total counter
vllm:num_requests_waiting_total 99.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="a"} 0.25
# TYPE other gauge
other{x="vllm:kv_cache_usage_perc"} 5.0
"""


def test_gauges_read_as_prometheus_parser_reads_them() -> None:
    expected: dict[str, float] = {}
    for family in text_string_to_metric_families(PAGE):
        for sample in family.samples:
            if sample.name in VLLM_GAUGES:
                expected[sample.name] = expected.get(sample.name, 0.0) + float(sample.value)
    assert vllm_gauges(PAGE) == expected == {"vllm:num_requests_running": 5.0,
                                             "vllm:num_requests_waiting": 7.0,
                                             "vllm:kv_cache_usage_perc": 0.25}
    # the prefix-cache query counter, read by name from the same kind of page (its
    # _created sample and the gauges left out), summed over label sets
    page = PAGE + ("# TYPE vllm:prefix_cache_queries counter\n"
                   'vllm:prefix_cache_queries_total{engine="0"} 1200.0\n'
                   'vllm:prefix_cache_queries_total{engine="1"} 34.0\n'
                   'vllm:prefix_cache_queries_created{engine="0"} 1.7e9\n')
    assert vllm_gauges(page, PREFIX_COUNTERS) == {PREFIX_QUERIES: 1234.0}
    assert vllm_gauges(page) == expected


def test_loop_lag_summary_over_a_window() -> None:
    lag = LoopLag(period_s=0.01, keep_s=10.0)
    for i in range(200):   # loop time i/10 s, lag i/1000 ms... 199 us at the end
        lag.add(i / 10, i * 1e-6)
    s = lag.summary(since=10.0)   # the samples kept (t >= 9.9) and at/after 10 s: 100..199
    assert s.samples == 100
    assert s.p50_ms == pytest.approx(0.1495)
    assert s.p99_ms == pytest.approx(0.19801)
    assert s.max_ms == pytest.approx(0.199)
    assert lag.summary(since=100.0).samples == 0


def test_price_sums_count_a_non_finite_price_as_zero() -> None:
    prices = np.zeros((2, 4, len(RESOURCES)))
    prices[0, :, 0] = [1.0, 2.0, np.inf, 0.5]
    prices[1, 1, -1] = np.nan
    prices[1, 2, -1] = 3.0
    m = ServerMetrics()
    m.set_price_sums(["a", "b"], prices)
    got = {(s.labels["instance"], s.labels["resource"]): s.value
           for f in m.price_sum.collect() for s in f.samples}
    assert got[("a", RESOURCES[0])] == 3.5 and got[("b", RESOURCES[-1])] == 3.0
    assert len(got) == 2 * len(RESOURCES)


@pytest.mark.parametrize("row", [(1.5, 2.0, -0.0), (1, 2, 3), (np.float64(0.25), 1.0),
                                 (1.0, float("inf")), (float("-inf"), float("nan"), 2)])
def test_explanation_rows_are_floats_with_non_finite_as_1e308(row: tuple[float, ...]) -> None:
    """Every figure a float, as float() makes it, and a non-finite one 1e308 (JSON has no
    infinity), whether the row is all finite (one pass in C) or not."""
    doc = explanation_doc({"a": row, "b": (0.5,)}, {"source": "max_tokens"})
    want = [float(x) if np.isfinite(x) else 1e308 for x in row]
    assert doc["a"] == want and all(type(x) is float for x in doc["a"])
    assert list(doc) == ["a", "b", "prediction"] and doc["b"] == [0.5]
