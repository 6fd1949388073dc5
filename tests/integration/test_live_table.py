"""bench/live_table.py's live path, quick: the same requests through ``olproute serve`` (its
own process) in front of ``olproute emulate`` (its own process), every request finished
or refused with a reason, and the simulator's replay of the same requests beside it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import live_table  # noqa: E402

from olproute.sim.scenario import CalibrationSource  # noqa: E402


def _check_replies(case: live_table.Case, per: live_table.PerRequest,
                   side: dict[str, object]) -> None:
    n = len(case.requests)
    assert per.served.shape == (n,)
    not_served = side["not_served"]
    assert isinstance(not_served, dict)
    # every request either finished (complete stream, a finish reason) or was refused
    # with a reason the router gave
    assert int(per.served.sum()) + sum(not_served.values()) == n
    for key in not_served:
        status, _, reason = key.partition(" ")
        assert status in {"429", "503"}, key
        assert reason and reason != "None", key
    served = per.served
    assert np.all(np.isfinite(per.ttft[served])) and np.all(per.ttft[served] > 0)
    assert np.all(per.eel[served] >= per.ttft[served])
    finish = side["finish_reasons"]
    assert isinstance(finish, dict)
    assert finish["stop"] + finish["length"] == int(served.sum())


def test_olp_bid_price_live_quick(tmp_path: Path) -> None:
    case = live_table.olp_case(10, 30, tmp_path)
    truth = live_table.write_truth(case, tmp_path)
    per, side = live_table.run_live(case, "bid_price", tmp_path, truth)
    _check_replies(case, per, side)
    # the emulated model stopped where the truth says: no request hit max_tokens (2,048,
    # above every splitwise_conv output), so every served one ended with "stop", and the
    # live tokens are the simulator's (prompt + true output) for each served request
    assert side["finish_reasons"] == {"stop": int(per.served.sum()), "length": 0}
    sim = live_table.run_sim(case, "bid_price", CalibrationSource(case.loaded))
    both = per.served & sim.served
    assert both.sum() >= 0.9 * len(case.requests)
    assert np.array_equal(per.tokens[both], sim.tokens[both])


def test_bear_round_robin_live_quick(tmp_path: Path) -> None:
    case = live_table.bear_case(10, 20, live_table.predictor_dir())
    truth = live_table.write_truth(case, tmp_path)
    per, side = live_table.run_live(case, "round_robin", tmp_path, truth)
    _check_replies(case, per, side)
    # round robin refuses nothing and goes round the three models (the client asks for
    # no particular one); every request got the tokens its prompt's truth gives on the
    # model of the instance that served it
    assert per.served.all() and per.instance is not None
    model = {s.name: s.model for s in case.loaded.specs}
    assert {model[str(i)] for i in per.instance} == set(model.values())
    for r, mt, name, tokens in zip(case.requests, case.max_tokens, per.instance, per.tokens,
                                   strict=True):
        assert tokens == r.prompt_tokens + min(r.true_decode_tokens(model[str(name)]), mt)
