"""The built-in schedules: GPipe, 1F1B, interleaved 1F1B, zero-bubble H1, custom."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from multimesh import _compat
from multimesh.schedules._core import (
    Action,
    Order,
    Schedule,
    as_action,
    dependencies,
    validate,
)

_compat.register_exclusion(__file__)


@dataclasses.dataclass(frozen=True)
class GPipe(Schedule):
    """All forwards, then all backwards (Huang et al. 2019). Holds M activations."""

    name: str = dataclasses.field(default="gpipe", init=False)

    def order(self, num_submeshes: int, num_microbatches: int, num_chunks: int = 1) -> Order:
        out: Order = []
        for s in range(num_submeshes):
            stages = [c * num_submeshes + s for c in range(num_chunks)]
            row = [Action(v, k, "F") for k in range(num_microbatches) for v in stages]
            row += [Action(v, k, "B") for k in range(num_microbatches) for v in reversed(stages)]
            out.append(row)
        return out


@dataclasses.dataclass(frozen=True)
class OneFOneB(Schedule):
    """One forward, one backward (PipeDream-flush): at most S - s activations in flight."""

    name: str = dataclasses.field(default="1f1b", init=False)

    def order(self, num_submeshes: int, num_microbatches: int, num_chunks: int = 1) -> Order:
        if num_chunks != 1:
            raise ValueError(
                "OneFOneB runs one stage per submesh; for several stages per submesh use "
                "Interleaved1F1B()."
            )
        S, M = num_submeshes, num_microbatches
        out: Order = []
        for s in range(S):
            w = min(S - 1 - s, M)
            row = [Action(s, k, "F") for k in range(w)]
            for i in range(M - w):
                row += [Action(s, w + i, "F"), Action(s, i, "B")]
            row += [Action(s, i, "B") for i in range(M - w, M)]
            out.append(row)
        return out


@dataclasses.dataclass(frozen=True)
class Interleaved1F1B(Schedule):
    """Interleaved 1F1B (Narayanan et al. 2021): V stages ("chunks") per submesh, stage v
    on submesh v % S; cuts the bubble by about V. Needs M divisible by S."""

    num_chunks: int | None = None
    name: str = dataclasses.field(default="interleaved-1f1b", init=False)

    def chunks(self, num_submeshes: int, num_stages: int | None = None) -> int:
        if self.num_chunks is not None:
            return self.num_chunks
        if num_stages is None:
            return 2
        return max(1, num_stages // num_submeshes)

    def order(self, num_submeshes: int, num_microbatches: int, num_chunks: int = 1) -> Order:
        S, M, V = num_submeshes, num_microbatches, num_chunks
        if M % S:
            raise ValueError(
                f"Interleaved1F1B needs num_microbatches ({M}) divisible by the number of "
                f"submeshes ({S}); use {M + (-M) % S} microbatches, or OneFOneB()."
            )
        total = M * V

        def mb(i: int) -> int:
            return (i // (S * V)) * S + i % S

        out: Order = []
        for s in range(S):
            fwd = [Action(((i // S) % V) * S + s, mb(i), "F") for i in range(total)]
            bwd = [Action((V - 1 - (i // S) % V) * S + s, mb(i), "B") for i in range(total)]
            w = min((S - s - 1) * 2 + (V - 1) * S, total)
            row = fwd[:w]
            for j in range(total - w):
                row += [fwd[w + j], bwd[j]]
            row += bwd[total - w :]
            out.append(row)
        return out


@dataclasses.dataclass(frozen=True)
class ZeroBubbleH1(Schedule):
    """Zero-bubble H1 (Qi et al. 2023): the backward is split into input-gradient (B) and
    weight-gradient (W) parts; W work is deferred into bubbles, at 1F1B's memory."""

    name: str = dataclasses.field(default="zero-bubble-h1", init=False)
    splits_backward: bool = dataclasses.field(default=True, init=False)

    def order(self, num_submeshes: int, num_microbatches: int, num_chunks: int = 1) -> Order:
        if num_chunks != 1:
            raise ValueError("ZeroBubbleH1 runs one stage per submesh.")
        return _greedy(num_submeshes, num_microbatches, limit=lambda s: num_submeshes - s)


def _greedy(S: int, M: int, limit: Any) -> Order:
    """List-schedule with unit costs: B first, then F (while fewer than ``limit(s)``
    microbatches are in flight), then W; record each submesh's order."""
    done: dict[Action, float] = {}
    free = [0.0] * S
    nextf = [0] * S
    pending_b: list[list[int]] = [[] for _ in range(S)]
    pending_w: list[list[int]] = [[] for _ in range(S)]
    in_flight = [0] * S
    out: Order = [[] for _ in range(S)]
    total = 3 * S * M
    while len(done) < total:
        best = None
        for s in range(S):
            cands = []
            for k in pending_b[s]:
                a = Action(s, k, "B")
                deps = dependencies(a, S, True)
                if all(d in done for d in deps):
                    cands.append((0, max([free[s]] + [done[d] for d in deps]), a))
            if nextf[s] < M and in_flight[s] < limit(s):
                a = Action(s, nextf[s], "F")
                deps = dependencies(a, S, True)
                if all(d in done for d in deps):
                    cands.append((1, max([free[s]] + [done[d] for d in deps]), a))
            for k in pending_w[s]:
                a = Action(s, k, "W")
                cands.append((2, max(free[s], done[Action(s, k, "B")]), a))
            if not cands:
                continue
            # earliest start first; among equal starts, B > F > W
            pick = min(cands, key=lambda c: (c[1], c[0], c[2].microbatch))
            if best is None or (pick[1], pick[2].stage) < (best[1], best[2].stage):
                best = pick
        assert best is not None, "greedy schedule stalled"
        _, start, a = best
        s = a.stage
        done[a] = start + 1.0
        free[s] = start + 1.0
        out[s].append(a)
        if a.phase == "F":
            nextf[s] += 1
            in_flight[s] += 1
            pending_b[s].append(a.microbatch)
        elif a.phase == "B":
            pending_b[s].remove(a.microbatch)
            pending_w[s].append(a.microbatch)
        else:
            pending_w[s].remove(a.microbatch)
            in_flight[s] -= 1
    return out


@dataclasses.dataclass(frozen=True)
class Custom(Schedule):
    """A user-given order: one list of (stage, microbatch, phase) per submesh."""

    steps: tuple[tuple[tuple[int, int, str], ...], ...] = ()
    name: str = dataclasses.field(default="custom", init=False)

    def __init__(self, order: Sequence[Sequence[Any]]) -> None:
        try:
            rows = [list(row) for row in order]
        except TypeError:
            raise ValueError(
                "Custom(order) takes one list of (stage, microbatch, phase) per submesh."
            ) from None
        steps = tuple(
            tuple(tuple(as_action(a, s, j)) for j, a in enumerate(row))
            for s, row in enumerate(rows)
        )
        object.__setattr__(self, "steps", steps)

    @property
    def splits_backward(self) -> bool:  # type: ignore[override]
        return any(a[2] == "W" for row in self.steps for a in row)

    def chunks(self, num_submeshes: int, num_stages: int | None = None) -> int:
        top = max((a[0] for row in self.steps for a in row), default=0)
        return max(1, -(-(top + 1) // max(num_submeshes, 1)))

    def order(self, num_submeshes: int, num_microbatches: int, num_chunks: int = 1) -> Order:
        return validate(
            [list(r) for r in self.steps],
            num_submeshes,
            num_microbatches,
            num_chunks,
            self.splits_backward,
        )


_NAMES = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "interleaved-1f1b": Interleaved1F1B,
    "interleaved": Interleaved1F1B,
    "zero-bubble-h1": ZeroBubbleH1,
    "zb-h1": ZeroBubbleH1,
}


def get(schedule: Any) -> Schedule:
    """A schedule from a name (``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``,
    ``"zero-bubble-h1"``) or a Schedule instance."""
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, str) and schedule.lower() in _NAMES:
        return _NAMES[schedule.lower()]()
    if isinstance(schedule, type) and issubclass(schedule, Schedule) and schedule is not Custom:
        return schedule()
    raise ValueError(
        f"unknown schedule {schedule!r}; use one of {sorted(set(_NAMES) - {'interleaved', 'zb-h1'})}"
        " or a multimesh.schedules.Schedule (e.g. Custom(order))."
    )
