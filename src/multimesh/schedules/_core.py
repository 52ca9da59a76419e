"""Schedules as data: for each submesh, the ordered list of actions it runs.

An action is (stage, microbatch, phase): phase ``"F"`` (forward), ``"B"`` (backward; for
schedules that split it, the input-gradient part) or ``"W"`` (weight-gradient part).
``stage`` is the (virtual) pipeline stage; with interleaving, stage ``v`` runs on
submesh ``v % num_submeshes``. Every schedule can be validated against pipeline data
dependencies (a deadlocking order is a clear error naming the first step that cannot
run) and simulated (``multimesh.schedules.simulate``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from multimesh import _compat

_compat.register_exclusion(__file__)

PHASES = ("F", "B", "W")


class Action(NamedTuple):
    """One unit of pipeline work: a (virtual) stage's phase for one microbatch."""

    stage: int
    microbatch: int
    phase: str

    def __str__(self) -> str:
        return f"{self.phase}{self.microbatch}@s{self.stage}"


Order = list[list[Action]]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Base class: subclasses build the per-submesh action lists."""

    name: str = dataclasses.field(default="schedule", init=False)

    #: whether the backward is split into input-gradient (B) and weight-gradient (W) parts
    splits_backward: bool = dataclasses.field(default=False, init=False)

    def chunks(self, num_submeshes: int, num_stages: int | None = None) -> int:
        """Virtual stages per submesh (1 unless interleaved)."""
        return 1

    def order(self, num_submeshes: int, num_microbatches: int, num_chunks: int = 1) -> Order:
        raise NotImplementedError

    def build(
        self,
        num_submeshes: int,
        num_microbatches: int,
        num_chunks: int = 1,
        *,
        backward: bool = True,
    ) -> Order:
        """The validated order for this pipeline shape; ``backward=False`` for a loop
        without a backward (inference): its forward steps only."""
        _check_shape(num_submeshes, num_microbatches, num_chunks)
        if not backward:
            return self.forward_order(num_submeshes, num_microbatches, num_chunks)
        order = self.order(num_submeshes, num_microbatches, num_chunks)
        validate(order, num_submeshes, num_microbatches, num_chunks, self.splits_backward)
        return order

    def forward_order(
        self, num_submeshes: int, num_microbatches: int, num_chunks: int = 1
    ) -> Order:
        """The order's forward steps, for a loop without a backward."""
        order = self.order(num_submeshes, num_microbatches, num_chunks)
        order = [[a for a in row if a.phase == "F"] for row in order]
        validate(order, num_submeshes, num_microbatches, num_chunks, forward_only=True)
        return order


def _check_shape(num_submeshes: int, num_microbatches: int, num_chunks: int) -> None:
    for name, v in (
        ("num_submeshes", num_submeshes),
        ("num_microbatches", num_microbatches),
        ("num_chunks", num_chunks),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}.")


def dependencies(a: Action, num_stages: int, splits_backward: bool) -> list[Action]:
    """The actions ``a`` needs: the pipeline's data dependencies, and the order in which
    ``mm.jit`` accumulates outputs and gradients across microbatches (on each stage,
    each phase handles microbatch k after microbatch k-1)."""
    s, k, p = a
    deps = [Action(s, k - 1, p)] if k > 0 else []
    if p == "F":
        if s > 0:
            deps.append(Action(s - 1, k, "F"))
        return deps
    if p == "B":
        deps.append(Action(s, k, "F"))
        if s < num_stages - 1:
            deps.append(Action(s + 1, k, "B"))
        return deps
    deps.append(Action(s, k, "B"))
    return deps


def expected_actions(
    num_submeshes: int,
    num_microbatches: int,
    num_chunks: int,
    splits_backward: bool,
    forward_only: bool = False,
) -> list[set[Action]]:
    phases = ("F",) if forward_only else ("F", "B", "W") if splits_backward else ("F", "B")
    out: list[set[Action]] = [set() for _ in range(num_submeshes)]
    for v in range(num_submeshes * num_chunks):
        for k in range(num_microbatches):
            for p in phases:
                out[v % num_submeshes].add(Action(v, k, p))
    return out


def as_action(a: Any, submesh: int, step: int) -> Action:
    """Check one schedule entry and return it as an :class:`Action`."""
    try:
        st, k, p = a
    except (TypeError, ValueError):
        raise ValueError(
            f"schedule step {step} on submesh {submesh}: {a!r} is not a (stage, microbatch, "
            "phase) triple."
        ) from None
    for what, v in (("stage", st), ("microbatch", k)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(
                f"schedule step {step} on submesh {submesh}: {what} {v!r} in {a!r} is not "
                "an int; actions are (stage: int, microbatch: int, phase: 'F'|'B'|'W')."
            )
    if p not in PHASES:
        raise ValueError(
            f"schedule step {step} on submesh {submesh}: phase {p!r} is not one of {PHASES}."
        )
    if st < 0 or k < 0:
        raise ValueError(
            f"schedule step {step} on submesh {submesh}: {a!r} has a negative "
            f"{'stage' if st < 0 else 'microbatch'}; stages and microbatches count from 0."
        )
    return Action(int(st), int(k), str(p))


def validate(
    order: Sequence[Sequence[Any]],
    num_submeshes: int,
    num_microbatches: int,
    num_chunks: int = 1,
    splits_backward: bool | None = None,
    forward_only: bool = False,
) -> Order:
    """Check that an order runs every action once, on its submesh, without deadlock
    (``forward_only``: the forward actions of a loop without a backward)."""
    if not isinstance(order, (list, tuple)) or len(order) != num_submeshes:
        raise ValueError(
            f"a schedule order needs one list of actions per submesh ({num_submeshes}), "
            f"got {len(order) if isinstance(order, (list, tuple)) else type(order).__name__}."
        )
    acts: Order = []
    for s, row in enumerate(order):
        r = []
        for j, a in enumerate(row):
            r.append(as_action(a, s, j))
        acts.append(r)
    if splits_backward is None:
        splits_backward = any(a.phase == "W" for row in acts for a in row)
    want = expected_actions(
        num_submeshes, num_microbatches, num_chunks, splits_backward, forward_only
    )
    num_stages = num_submeshes * num_chunks
    for s, row in enumerate(acts):
        seen: set[Action] = set()
        for j, a in enumerate(row):
            if a not in want[s] and not 0 <= a.stage < num_stages:
                raise ValueError(
                    f"schedule step {j} on submesh {s}: {a} names stage {a.stage}, but the "
                    f"loop has {num_stages} stages (0..{num_stages - 1}: {num_submeshes} "
                    f"submeshes x {num_chunks} chunk{'s' if num_chunks != 1 else ''}); was "
                    "the order made for another number of stages?"
                )
            if a not in want[s] and not 0 <= a.microbatch < num_microbatches:
                raise ValueError(
                    f"schedule step {j} on submesh {s}: {a} names microbatch {a.microbatch}, "
                    f"but the loop has {num_microbatches} (0..{num_microbatches - 1}); was the "
                    "order made for another number of microbatches?"
                )
            if a not in want[s]:
                raise ValueError(
                    f"schedule step {j} on submesh {s}: {a} does not belong there (stage "
                    f"{a.stage} runs on submesh {a.stage % num_submeshes}; microbatches "
                    f"0..{num_microbatches - 1}; {num_stages} stages)."
                )
            if a in seen:
                raise ValueError(f"schedule step {j} on submesh {s}: {a} appears twice.")
            seen.add(a)
        missing = sorted(want[s] - seen)
        if missing:
            raise ValueError(
                f"schedule for submesh {s} is missing {len(missing)} action(s), e.g. {missing[0]}."
            )
    # deadlock check: run in rounds
    pos = [0] * num_submeshes
    done: set[Action] = set()
    total = sum(len(r) for r in acts)
    while len(done) < total:
        progressed = False
        for s in range(num_submeshes):
            while pos[s] < len(acts[s]):
                a = acts[s][pos[s]]
                if all(d in done for d in dependencies(a, num_stages, splits_backward)):
                    done.add(a)
                    pos[s] += 1
                    progressed = True
                else:
                    break
        if not progressed:
            _report_stuck(acts, pos, done, num_submeshes, num_stages, splits_backward)
    return acts


def _report_stuck(
    acts: list[list[Action]],
    pos: list[int],
    done: set[Action],
    num_submeshes: int,
    num_stages: int,
    splits_backward: bool,
) -> None:
    """Name the real blocker of a stuck order: a step that needs an action its own
    submesh runs later, or else the cycle of submeshes each waiting on the next."""

    def blocker(s: int) -> tuple[Action, Action, int, int]:
        a = acts[s][pos[s]]
        unmet = [d for d in dependencies(a, num_stages, splits_backward) if d not in done]
        own = [d for d in unmet if d.stage % num_submeshes == s]
        d = (own or unmet)[0]
        owner = d.stage % num_submeshes
        return a, d, owner, acts[owner].index(d)

    s = next(s for s in range(num_submeshes) if pos[s] < len(acts[s]))
    chain: list[int] = []
    while s not in chain:
        a, d, owner, at = blocker(s)
        if owner == s:
            raise ValueError(
                f"invalid schedule: step {pos[s]} on submesh {s} ({a}) cannot run: it needs "
                f"{d}, which the same submesh only runs later, at its step {at}. Reorder the "
                "steps."
            )
        chain.append(s)
        s = owner
    cycle = chain[chain.index(s) :]
    waits = []
    for c in cycle:
        a, d, owner, at = blocker(c)
        waits.append(f"step {pos[c]} on submesh {c} ({a}) needs {d} (submesh {owner}'s step {at})")
    a, d, owner, at = blocker(cycle[0])
    raise ValueError(
        f"invalid schedule: step {pos[cycle[0]]} on submesh {cycle[0]} ({a}) cannot run: it "
        f"needs {d}, which submesh {owner} only runs at its step {at}, after work that waits "
        f"on this one (deadlock: {'; '.join(waits)}). Reorder the steps."
    )
