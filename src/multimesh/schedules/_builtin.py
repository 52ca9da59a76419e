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
            # chunk by chunk: every microbatch through a submesh's first stage before any
            # goes through its next one (microbatch by microbatch made each one cross the
            # whole pipeline before the next started: nearly serial)
            stages = [c * num_submeshes + s for c in range(num_chunks)]
            row = [Action(v, k, "F") for v in stages for k in range(num_microbatches)]
            row += [Action(v, k, "B") for v in reversed(stages) for k in range(num_microbatches)]
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
    on submesh v % S; cuts the bubble by about V. Needs M divisible by S (with V = 1 it is
    1F1B, which does not)."""

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
        if V == 1:  # one stage per submesh: 1F1B itself (as Megatron falls back to it);
            # interleaving's warm-up would hold twice 1F1B's activations for no gain
            return OneFOneB().order(S, M)
        if M % S:
            raise ValueError(
                f"Interleaved1F1B needs num_microbatches ({M}) divisible by the number of "
                f"submeshes the pipeline's tasks use ({S}); use {M + (-M) % S} microbatches, "
                "or OneFOneB()."
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
    weight-gradient (W) parts. F and B run in 1F1B's order; each W waits until its
    submesh would otherwise idle, filling 1F1B's bubbles. A submesh holds at most S
    microbatches (forward started, W not done): the peak 1F1B's first submesh has, so
    the pipeline's peak memory is 1F1B's (later submeshes hold more than under 1F1B).
    With equal F, B and W costs and M >= S the step takes 3M + S - 1 units: a bubble of
    (S - 1) / (3M + S - 1), against 1F1B's (S - 1) / (M + S - 1)."""

    name: str = dataclasses.field(default="zero-bubble-h1", init=False)
    splits_backward: bool = dataclasses.field(default=True, init=False)

    def order(self, num_submeshes: int, num_microbatches: int, num_chunks: int = 1) -> Order:
        if num_chunks != 1:
            raise ValueError("ZeroBubbleH1 runs one stage per submesh.")
        return _fill_with_w(num_submeshes, num_microbatches)


def _fill_with_w(S: int, M: int) -> Order:
    """1F1B's order of F and B on each submesh, with every W placed by a unit-cost list
    schedule: a submesh runs its next F or B if it can start now, else its oldest pending
    W (an F also waits while S microbatches are in flight); leftover Ws run at the end."""
    fb: list[list[Action]] = OneFOneB().order(S, M)
    pos = [0] * S
    free = [0.0] * S
    done: dict[Action, float] = {}
    pending_w: list[list[int]] = [[] for _ in range(S)]
    in_flight = [0] * S
    out: Order = [[] for _ in range(S)]
    while len(done) < 3 * S * M:
        best: tuple[float, int, int, Action] | None = None
        for s in range(S):
            cands: list[tuple[float, int, Action]] = []
            if pos[s] < len(fb[s]):
                a = fb[s][pos[s]]
                deps = dependencies(a, S, True)
                if all(d in done for d in deps) and (a.phase != "F" or in_flight[s] < S):
                    cands.append((max([free[s]] + [done[d] for d in deps]), 0, a))
            if pending_w[s]:
                a = Action(s, pending_w[s][0], "W")
                cands.append((max(free[s], done[Action(s, a.microbatch, "B")]), 1, a))
            if cands:
                start, kind, a = min(cands, key=lambda c: (c[0], c[1]))
                if best is None or (start, s) < (best[0], best[1]):
                    best = (start, s, kind, a)
        assert best is not None, "zero-bubble schedule stalled"
        start, s, _kind, a = best
        done[a] = free[s] = start + 1.0
        out[s].append(a)
        if a.phase == "W":
            pending_w[s].pop(0)
            in_flight[s] -= 1
            continue
        pos[s] += 1
        if a.phase == "F":
            in_flight[s] += 1
        else:
            pending_w[s].append(a.microbatch)
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

    def forward_order(
        self, num_submeshes: int, num_microbatches: int, num_chunks: int = 1
    ) -> Order:
        """For a loop without a backward: an order of F steps only, or a full order's F
        steps."""
        if any(a[2] != "F" for row in self.steps for a in row):
            return super().forward_order(num_submeshes, num_microbatches, num_chunks)
        rows = [list(r) for r in self.steps]
        return validate(rows, num_submeshes, num_microbatches, num_chunks, forward_only=True)

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
