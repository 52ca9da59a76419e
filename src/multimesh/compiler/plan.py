"""Plan: the MPMD program as a flat list of steps over numbered value slots.

A slot holds one value on one stage. Steps, in order: put the inputs where they are
needed, then for each fragment (in (level, stage) order) run it, and right after it
send the values it produced that other stages need (one batched transfer step). Each
step lists the slots whose last use it is, so the runtime frees buffers as it goes.
The plan is plain data: ``.fragments`` and ``.transfers`` describe it, ``as_text()``
prints it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from multimesh import _compat
from multimesh.compiler.fragment import Fragment, Slot
from multimesh.compiler.ir import FlatProgram, Labels, Literal, Placement, aval_nbytes

_compat.register_exclusion(__file__)


@dataclasses.dataclass(frozen=True)
class FragmentInfo:
    """One compiled program on one submesh."""

    name: str
    stage: int
    devices: tuple[int, ...]
    tasks: tuple[str, ...]
    level: int
    num_eqns: int
    backward: bool


@dataclasses.dataclass(frozen=True)
class TransferInfo:
    """One value moved between submeshes."""

    src_stage: int
    dst_stage: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    after: str  # the fragment that produced it, or "inputs"
    values: int = 1  # program values moved in it (small values are packed together)


@dataclasses.dataclass(frozen=True)
class InputPut:
    """How a program input (or constant) reaches a stage each call."""

    arg: int  # flat argument index; -1 - k for constant k
    stage: int
    mode: str  # "as_is" | "extract" | "put" | "host_slice" | "host_const" | "piece" | "const"
    nbytes: int


@dataclasses.dataclass
class Step:
    kind: str  # "inputs" | "run" | "transfer"
    fragment: int = -1
    items: list[Any] = dataclasses.field(default_factory=list)
    free: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Plan:
    """The MPMD plan as data."""

    fragments: list[FragmentInfo]
    transfers: list[TransferInfo]
    inputs: list[InputPut]
    steps: list[Step]
    frags: list[Fragment]
    slots: dict[Slot, int]
    outputs: list[Any]  # per program output: ("literal", value) | ("slots", [slot ids])
    stage_names: dict[int, str]

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def as_text(self) -> str:
        """The plan as text: fragments in dispatch order, each followed by the values it
        sends to other submeshes."""
        nvals = sum(t.values for t in self.transfers)
        lines = [
            f"MPMD plan: {len(self.fragments)} fragments, {len(self.transfers)} transfers of "
            f"{nvals} values ({sum(t.nbytes for t in self.transfers)} bytes between submeshes)"
        ]
        puts = [p for p in self.inputs if p.mode in ("put", "host_slice")]
        made = [p for p in self.inputs if p.mode == "host_const"]
        placed = [p for p in self.inputs if p.mode in ("as_is", "extract")]
        if puts:
            cut = sum(p.mode == "host_slice" for p in puts)
            lines.append(
                f"  inputs: {len(puts)} put from the host or other devices "
                f"({sum(p.nbytes for p in puts)} bytes"
                + (f"; {cut} of them slices cut on the host)" if cut else ")")
            )
        if placed:
            lines.append(f"  inputs: {len(placed)} used where they already are")
        if made:
            lines.append(
                f"  inputs: {len(made)} small constants made on the host once "
                "(accumulator zeros, microbatch offsets)"
            )
        tr_by_after: dict[str, list[TransferInfo]] = {}
        for t in self.transfers:
            tr_by_after.setdefault(t.after, []).append(t)

        def row(t: TransferInfo, indent: str, note: str = "") -> str:
            what = f" ({t.values} values packed)" if t.values > 1 else ""
            return (
                f"{indent}transfer stage{t.src_stage}->stage{t.dst_stage} "
                f"{t.dtype}{list(t.shape)} {t.nbytes}B{what}{note}"
            )

        for t in tr_by_after.get("inputs", []):
            lines.append(row(t, "  ", " (input)"))
        for k, f in enumerate(self.fragments):
            tasks = ",".join(f.tasks) if f.tasks else "-"
            lines.append(
                f"  {k:>3} fragment {f.name!r}: stage {f.stage} (devices {list(f.devices)}), "
                f"{f.num_eqns} ops, tasks [{tasks}]"
            )
            for t in tr_by_after.get(f.name, []):
                lines.append(row(t, "        "))
        return "\n".join(lines)


def _frag_info(
    prog: FlatProgram, labels: Labels, f: Fragment, names_used: dict[str, int]
) -> FragmentInfo:
    tasks: list[str] = []
    backward = False
    forward = False
    for i in f.eqns:
        ref = labels.tasks[i]
        if ref is not None and ref.name not in tasks:
            tasks.append(ref.name)
        if _compat.is_transposed(prog.eqns[i].source_info.name_stack):
            backward = True
        else:
            forward = True
    base = "+".join(tasks) if tasks else f"stage{f.stage}"
    if f.actions:
        base += ":" + "+".join(f"{a.phase}{a.microbatch}" for a in f.actions)
    elif backward and not forward:
        base += ".bwd"
    elif backward:
        base += ".fwd+bwd"
    n = names_used.get(base, 0)
    names_used[base] = n + 1
    name = base if n == 0 else f"{base}#{n}"
    t = labels.targets[f.stage]
    return FragmentInfo(
        name=name,
        stage=f.stage,
        devices=t.device_ids,
        tasks=tuple(tasks),
        level=f.level,
        num_eqns=len(f.eqns),
        backward=backward and not forward,
    )


def build_plan(
    prog: FlatProgram,
    labels: Labels,
    placement: Placement,
    frags: list[Fragment],
    input_modes: list[str],
) -> Plan:
    """Order the steps, number the slots, and compute last uses."""
    slots: dict[Slot, int] = {}

    def sid(slot: Slot) -> int:
        if slot not in slots:
            slots[slot] = len(slots)
        return slots[slot]

    arg_index = {v: k for k, v in enumerate(prog.invars)}
    const_index = {v: k for k, v in enumerate(prog.constvars)}
    steps: list[Step] = []
    inputs: list[InputPut] = []
    in_step = Step("inputs")
    for v, stages in placement.input_stages.items():
        for s in stages:
            if v in arg_index:
                k = arg_index[v]
                mode = input_modes[k]
            else:
                k = -1 - const_index[v]
                mode = "const"
            ip = InputPut(arg=k, stage=s, mode=mode, nbytes=aval_nbytes(v.aval))
            inputs.append(ip)
            in_step.items.append((ip, sid((v, s))))
    steps.append(in_step)

    infos: list[FragmentInfo] = []
    names_used: dict[str, int] = {}
    for f in frags:
        infos.append(_frag_info(prog, labels, f, names_used))

    transfers_from: dict[Slot, list[int]] = {}
    for v, src, dst in placement.transfers:
        transfers_from.setdefault((v, src), []).append(dst)
    transfers: list[TransferInfo] = []

    def transfer_step(slots_made: list[Slot], after: str) -> None:
        items = []
        for slot in slots_made:
            v, src = slot
            for dst in transfers_from.get(slot, ()):
                items.append((sid(slot), sid((v, dst)), v.aval, src, dst))
                transfers.append(
                    TransferInfo(
                        src_stage=src,
                        dst_stage=dst,
                        nbytes=aval_nbytes(v.aval),
                        shape=tuple(v.aval.shape),
                        dtype=str(v.aval.dtype),
                        after=after,
                        values=placement.packed.get(v, 1),
                    )
                )
        if items:
            steps.append(Step("transfer", items=items))

    transfer_step([(v, s) for v, ss in placement.input_stages.items() for s in ss], "inputs")
    for k, f in enumerate(frags):
        for slot in f.inputs:
            sid(slot)
        for slot in f.outputs:
            sid(slot)
        steps.append(Step("run", fragment=k))
        transfer_step(f.outputs, infos[k].name)

    outputs: list[Any] = []
    keep: set[int] = set()
    for v, stages in zip(prog.outvars, placement.outputs):
        if isinstance(v, Literal):
            outputs.append(("literal", v.val, v.aval))
            continue
        ids = [slots[(v, s)] for s in stages]
        keep.update(ids)
        outputs.append(("slots", ids))

    # last uses -> frees
    last: dict[int, int] = {}
    for n, st in enumerate(steps):
        if st.kind == "run":
            for slot in frags[st.fragment].inputs:
                last[slots[slot]] = n
        elif st.kind == "transfer":
            for src, _dst, *_ in st.items:
                last[src] = n
    for sid_, n in last.items():
        if sid_ not in keep:
            steps[n].free.append(sid_)
    return Plan(
        fragments=infos,
        transfers=transfers,
        inputs=inputs,
        steps=steps,
        frags=frags,
        slots=slots,
        outputs=outputs,
        stage_names={t.index: t.name for t in labels.targets},
    )
