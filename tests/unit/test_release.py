"""policies/release.py: each value of bid_price's ``release`` names one rule, which says
whether the pass is joint and, for a joint one, which form of it runs."""

from __future__ import annotations

from typing import get_args

import pytest

from olproute.policies.bid_price import BidPriceParams
from olproute.policies.release import (
    Assignment,
    Chosen,
    Density,
    InOrder,
    ReleaseName,
    ReleaseRule,
    ScoreOrder,
    release_rule,
)


class _Pass:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def greedy(self, rule: ReleaseRule) -> Chosen:
        self.calls.append(f"greedy:{rule.name}")
        return [(0, 1)], {0}

    def exact(self) -> Chosen:
        self.calls.append("exact")
        return [], set()


def test_every_param_value_names_its_rule() -> None:
    values = get_args(ReleaseName)
    assert get_args(BidPriceParams.model_fields["release"].annotation) == values
    kinds = {"in_order": InOrder, "density": Density, "score": ScoreOrder,
             "assignment": Assignment}
    for v in values:
        rule = release_rule(v)
        assert isinstance(rule, kinds[v]) and rule.name == v
        assert rule.joint == (v != "in_order")
        assert rule.uses_mass == (v == "density")


def test_each_joint_rule_runs_its_form_of_the_pass() -> None:
    p = _Pass()
    assert release_rule("density").release(p) == ([(0, 1)], {0})
    release_rule("score").release(p)
    release_rule("assignment").release(p)
    assert p.calls == ["greedy:density", "greedy:score", "exact"]
    with pytest.raises(TypeError):
        release_rule("in_order").release(p)


def test_the_greedy_keys() -> None:
    assert ScoreOrder().key(2.0, None) == 2.0
    assert Density().key(2.0, 4.0) == 0.5
    assert Density().key(1.0, 0.0) == 1.0 / 1e-12
