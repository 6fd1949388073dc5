"""bid_price's release rules (``policy_params.bid_price.release``): how each slot's pass
decides the requests held in the router's buffer, as vLLM's ``RequestQueue`` has an FCFS
and a priority implementation behind one interface.

- ``in_order`` (``InOrder``): one by one in arrival order, each as ``decide`` would (the
  base ``Policy.decide_held``); not a joint pass.
- ``density`` (``Density``) and ``score`` (``ScoreOrder``): together, greedily in rounds
  (``JointPass.greedy``), each instance taking the requests that chose it in order of
  ``key``: score per use of the instance (``reward.column_mass``) or score.
- ``assignment`` (``Assignment``): together, as the exact assignment with the largest sum
  of scores that fits (``JointPass.exact``).

``release_rule`` picks the rule once from the parameter; the policy asks it ``joint``
(whether its held requests are decided together), ``uses_mass`` (whether its scores must
carry the column mass) and, for a joint pass, ``release``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal, Protocol

# (request index, instance) dispatches in the order chosen, and the requests that had an
# instance to go to
Chosen = tuple[list[tuple[int, int]], set[int]]
ReleaseName = Literal["in_order", "density", "score", "assignment"]


class JointPass(Protocol):
    """One slot's joint pass over the held requests, as the policy runs it."""

    def greedy(self, rule: ReleaseRule) -> Chosen:
        """In rounds, each instance taking the requests that chose it by ``rule.key``."""
        ...

    def exact(self) -> Chosen:
        """The exact assignment with the largest sum of scores that fits."""
        ...


class ReleaseRule(ABC):
    """How a slot's pass decides the held requests."""

    name: ClassVar[ReleaseName]
    joint: ClassVar[bool] = True        # decided together, from one context
    uses_mass: ClassVar[bool] = False   # ``key`` reads the column's mass

    @abstractmethod
    def release(self, joint: JointPass) -> Chosen:
        """The joint pass's dispatches (only for a rule with ``joint``)."""

    def key(self, score: float, mass: float | None) -> float:
        """The order in which an instance takes the requests that chose it (greedy pass):
        the score."""
        return score


class InOrder(ReleaseRule):
    """One by one in arrival order (the base ``decide_held``)."""

    name = "in_order"
    joint = False

    def release(self, joint: JointPass) -> Chosen:
        raise TypeError("release: in_order decides the held requests one by one")


class Density(ReleaseRule):
    """Greedily, by score per use of the instance (``reward.column_mass``)."""

    name = "density"
    uses_mass = True

    def release(self, joint: JointPass) -> Chosen:
        return joint.greedy(self)

    def key(self, score: float, mass: float | None) -> float:
        assert mass is not None
        key = score
        key /= max(mass, 1e-12)
        return key


class ScoreOrder(ReleaseRule):
    """Greedily, by score."""

    name = "score"

    def release(self, joint: JointPass) -> Chosen:
        return joint.greedy(self)


class Assignment(ReleaseRule):
    """The exact assignment with the largest sum of scores that fits."""

    name = "assignment"

    def release(self, joint: JointPass) -> Chosen:
        return joint.exact()


RULES: dict[str, type[ReleaseRule]] = {
    r.name: r for r in (InOrder, Density, ScoreOrder, Assignment)}


def release_rule(name: ReleaseName) -> ReleaseRule:
    """The rule the parameter names."""
    return RULES[name]()
