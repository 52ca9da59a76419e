"""Deterministic simulation of a schedule: timelines, makespan, bubble, memory."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from multimesh import _compat
from multimesh.schedules._builtin import get
from multimesh.schedules._core import Action, Order, dependencies

_compat.register_exclusion(__file__)


@dataclasses.dataclass(frozen=True)
class Event:
    action: Action
    start: float
    end: float
    label: str = ""


@dataclasses.dataclass
class Timeline:
    """Per-submesh events (simulated or measured)."""

    events: list[list[Event]]
    name: str = "schedule"
    #: most microbatches whose activations a submesh holds at once
    peak_in_flight: list[int] = dataclasses.field(default_factory=list)
    #: measured timelines: most bytes of live buffers per submesh during the step
    peak_live_bytes: list[int] = dataclasses.field(default_factory=list)
    #: the stage id of each row (measured timelines); default 0..n-1
    stages: list[int] = dataclasses.field(default_factory=list)

    def to_chrome_trace(self, path: str | None = None) -> dict[str, Any]:
        """A Chrome/Perfetto trace (``ui.perfetto.dev``); written as JSON to ``path``."""
        import json

        rows = self.stages or list(range(self.num_submeshes))
        evs: list[dict[str, Any]] = []
        for r, row in zip(rows, self.events):
            evs.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": 0,
                    "tid": r,
                    "args": {"name": f"submesh {r}"},
                }
            )
            for e in row:
                evs.append(
                    {
                        "name": e.label or str(e.action),
                        "ph": "X",
                        "pid": 0,
                        "tid": r,
                        "ts": e.start,
                        "dur": max(e.end - e.start, 0.0),
                        "args": {
                            "stage": e.action.stage,
                            "microbatch": e.action.microbatch,
                            "phase": e.action.phase,
                        },
                    }
                )
        trace = {"traceEvents": evs, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w") as fh:
                json.dump(trace, fh)
        return trace

    @property
    def num_submeshes(self) -> int:
        return len(self.events)

    @property
    def makespan(self) -> float:
        ends = [e.end for row in self.events for e in row]
        starts = [e.start for row in self.events for e in row]
        return (max(ends) - min(starts)) if ends else 0.0

    @property
    def busy(self) -> list[float]:
        return [sum(e.end - e.start for e in row) for row in self.events]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of submesh time between the first start and the last end."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_submeshes * span)

    def plot(self, path: str | None = None, ax: Any = None, title: str | None = None) -> Any:
        """A Gantt chart (matplotlib); saved as PNG when ``path`` is given."""
        import matplotlib

        if path is not None and ax is None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        fig = None
        if ax is None:
            fig, ax = plt.subplots(figsize=(12, 0.6 * self.num_submeshes + 1.5))
        colors = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
        many = len({e.action.stage for row in self.events for e in row}) > self.num_submeshes
        t0 = min((e.start for row in self.events for e in row), default=0.0)
        for s, row in enumerate(self.events):
            for e in row:
                ax.barh(
                    s,
                    e.end - e.start,
                    left=e.start - t0,
                    color=colors.get(e.action.phase, "gray"),
                    edgecolor="black",
                    linewidth=0.5,
                )
                ax.text(
                    e.start - t0 + (e.end - e.start) / 2,
                    s,
                    # interleaved: which of the submesh's stages (chunks) it is
                    f"{e.action.phase}{e.action.microbatch}"
                    + (f":{e.action.stage}" if many else ""),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
        ax.set_yticks(range(self.num_submeshes))
        rows = self.stages or list(range(self.num_submeshes))
        ax.set_yticklabels([f"submesh {s}" for s in rows])
        ax.invert_yaxis()
        ax.set_xlabel("time")
        ax.set_title(
            title or f"{self.name}: bubble {self.bubble_fraction:.1%}, makespan {self.makespan:.3g}"
        )
        if fig is not None:
            fig.tight_layout()
            if path is not None:
                fig.savefig(path, dpi=100)
                plt.close(fig)
        elif path is not None:  # the caller's axes: save their figure
            ax.figure.savefig(path, dpi=100)
        return ax


def simulate(
    schedule: Any,
    num_stages: int,
    num_microbatches: int,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    weight_cost: float | None = None,
    comm_cost: float = 0.0,
    num_chunks: int | None = None,
) -> Timeline:
    """Simulate ``schedule`` on ``num_stages`` submeshes with ``num_microbatches``
    (``num_stages`` counts submeshes: an interleaved schedule runs ``num_chunks`` task
    stages on each).

    Each action takes its phase's cost. For split backwards (zero-bubble), without
    ``weight_cost`` the ``backward_cost`` is shared half and half between B and W; with
    it, ``backward_cost`` is B's cost and ``weight_cost`` W's. An action starts when its
    submesh is free and its dependencies have finished (plus ``comm_cost`` when they ran
    on another submesh). ``peak_in_flight[s]``: most microbatches whose activations
    submesh ``s`` holds at once (forward started, backward (or W) not finished); with
    interleaving, each (microbatch, chunk) counts, so it can exceed the microbatches.
    ``num_chunks`` (interleaving: stages per submesh) defaults to the schedule's.
    """
    num_stages = _count("num_stages", num_stages)
    num_microbatches = _count("num_microbatches", num_microbatches)
    if num_chunks is not None:
        num_chunks = _count("num_chunks", num_chunks)
    costs = [("forward_cost", forward_cost), ("backward_cost", backward_cost)]
    costs += [("comm_cost", comm_cost)]
    if weight_cost is not None:
        costs.append(("weight_cost", weight_cost))
    for name, v in costs:
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"simulate: {name} must be a number, got {v!r}.")
        if not np.isfinite(v) or v < 0:
            raise ValueError(f"simulate: {name} must be finite and >= 0, got {v!r}.")
    sched = get(schedule)
    if weight_cost is not None and not sched.splits_backward:
        raise ValueError(
            f"simulate: weight_cost applies to schedules that split the backward "
            f"(zero-bubble); {sched.name!r} runs each backward whole (backward_cost)."
        )
    fixed = getattr(sched, "num_chunks", None)
    if num_chunks is not None and fixed is not None and fixed != num_chunks:
        raise ValueError(
            f"simulate: num_chunks={num_chunks} but the schedule was made with "
            f"num_chunks={fixed}; give one of them."
        )
    chunks = num_chunks if num_chunks is not None else sched.chunks(num_stages)
    order = sched.build(num_stages, num_microbatches, chunks)
    total_stages = num_stages * chunks
    split = sched.splits_backward
    if split:
        w = backward_cost / 2 if weight_cost is None else weight_cost
        b = backward_cost - w if weight_cost is None else backward_cost
        cost = {"F": forward_cost / chunks, "B": b / chunks, "W": w / chunks}
    else:
        cost = {"F": forward_cost / chunks, "B": backward_cost / chunks}
    return _run(order, num_stages, total_stages, split, cost, comm_cost, sched.name)


def _count(name: str, v: Any) -> int:
    """A positive int (NumPy ints too), or a ValueError naming the argument."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"simulate: {name} must be a positive int, got {v!r}.")
    return int(v)


def _run(
    order: Order,
    S: int,
    total_stages: int,
    split: bool,
    cost: dict[str, float],
    comm: float,
    name: str,
) -> Timeline:
    end: dict[Action, float] = {}
    pos = [0] * S
    free = [0.0] * S
    events: list[list[Event]] = [[] for _ in range(S)]
    n = sum(len(r) for r in order)
    while len(end) < n:
        progressed = False
        for s in range(S):
            while pos[s] < len(order[s]):
                a = order[s][pos[s]]
                deps = dependencies(a, total_stages, split)
                if not all(d in end for d in deps):
                    break
                ready = max(
                    [free[s]] + [end[d] + (comm if d.stage % S != s else 0.0) for d in deps]
                )
                fin = ready + cost[a.phase]
                end[a] = fin
                free[s] = fin
                events[s].append(Event(a, ready, fin))
                pos[s] += 1
                progressed = True
        if not progressed:  # validated orders cannot stall
            raise RuntimeError("schedule simulation stalled")
    last = "W" if split else "B"
    peaks = []
    for s in range(S):
        # a submesh runs its actions one after another: counted in their order (by
        # time, equal times included: zero costs put every action at 0)
        cur = peak = 0
        for e in events[s]:
            if e.action.phase == "F":
                cur += 1
                peak = max(peak, cur)
            elif e.action.phase == last:
                cur -= 1
        peaks.append(peak)
    return Timeline(events=events, name=name, peak_in_flight=peaks)
