"""Layers: pipeline a ``scan`` over stacked layers by splitting it into per-stage scans.

Most production models scan over stacked layers (MaxText ``scan_layers=True``, Flax
``nn.scan`` / ``nnx.scan``). A scan whose body holds a task with ``stage=mm.by_layer(...)``
(or a scope a ``task_rules`` entry maps to ``mm.by_layer(...)``) is split into one scan
per run of consecutive layers on the same stage: the stacked inputs are sliced by
iteration range, the carry flows from one stage's scan to the next (backwards for a
reversed scan, i.e. the backward pass), and the stacked outputs are concatenated.

Concatenations made here are remembered, so that

- slicing one again by the same ranges (the backward scan reading the forward's
  residuals) takes the pieces directly, without collecting them on one submesh;
- element-wise work on them (an optimizer update of stacked parameters) and reductions
  run per piece, on each piece's submesh;
- a program output that is such a concatenation, one range per stage in stage order,
  can be returned as one array sharded over the stage axis (see :func:`stage_outputs`).

A pure function over plain data, run after ``inline.flatten`` and before ``label``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from multimesh import _compat
from multimesh.compiler.inline import _sub_jaxprs, eqn_tasks, inner_tasks
from multimesh.compiler.ir import FlatProgram, Literal, use_counts
from multimesh.tasks import MARKER, TaskRef

_compat.register_exclusion(__file__)

Ranges = tuple[tuple[int, int, int], ...]  # (start, stop, stage) per run of layers

_ELEMENTWISE = {
    "abs", "add", "add_any", "and", "atan2", "ceil", "clamp", "convert_element_type", "copy",
    "copy_p", "cos", "div", "eq", "erf", "exp", "exp2", "expm1", "floor", "ge", "gt",
    "integer_pow", "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul",
    "ne", "neg", "nextafter", "not", "or", "pow", "rem", "round", "rsqrt", "select_n",
    "sign", "sin", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor",
}  # fmt: skip
_REDUCTIONS = {"reduce_sum": "add", "reduce_max": "max", "reduce_min": "min"}


@dataclasses.dataclass
class Split:
    """A value held as pieces along axis 0 (one per run of layers)."""

    ranges: Ranges
    pieces: list[Any]


def layer_spec(eqn: Any, rules: Any, limit: int) -> TaskRef | None:
    """The by-layer task of a scan eqn (from a task inside its body or a rule), if any."""
    refs = list(eqn_tasks(eqn))
    for sub in _sub_jaxprs(eqn.params):
        refs.extend(inner_tasks(sub, {}))
    if rules is not None:
        scopes = _compat.scope_names(eqn.source_info.name_stack)
        own = rules.match(scopes, limit)
        if own is not None:
            refs.append(own)
        refs.extend(rules.stages_inside(eqn.params, scopes, limit))
    layered = {r.layers: r for r in refs if r.layers is not None}
    if not layered:
        return None
    others = sorted({r.name for r in refs if r.layers is None})
    if others or len(layered) > 1:
        names = sorted({r.name for r in refs})
        raise ValueError(
            f"tasks {names} inside one scan: a scan split by layer (mm.by_layer) cannot "
            "also hold tasks with a fixed stage or another mm.by_layer; use one per scan."
        )
    return next(iter(layered.values()))


def split_scans(prog: FlatProgram, rules: Any, num_stages: int, limit: int) -> FlatProgram:
    """Split every scan placed by layer, and sums of row pads (:func:`split_row_pads`);
    push element-wise work through the pieces."""
    prog = split_row_pads(prog, num_stages)
    if not prog.splits and not any(e.primitive.name == "scan" for e in prog.eqns):
        return prog
    eqns: list[Any] = []
    splits: dict[Any, Split] = dict(prog.splits)
    changed = bool(splits)
    for e in prog.eqns:
        if e.primitive.name == "scan":
            ref = layer_spec(e, rules, limit)
            if ref is not None:
                _split_scan(e, ref, num_stages, eqns, splits)
                changed = True
                continue
        if splits and _push_through(e, eqns, splits):
            continue
        eqns.append(e)
    if not changed:
        return prog
    return dataclasses.replace(prog, eqns=_sink_slices(eqns), splits=splits)



def split_row_pads(prog: FlatProgram, num_stages: int) -> FlatProgram:
    """Sums of row-padded values are made per stage's block of rows: the gradient of a
    stacked array read row by row (``ws[i]`` in the task of the stage holding row ``i``
    of a stage-sharded stack) is each read's cotangent padded to the whole stack, the
    pads added up, which summed the whole stack across the stages. Each block now sums
    its own pads (zeros where none falls), so the gradient is held as per-stage pieces
    like a by-layer scan's, and updates of the stack run per piece."""
    if num_stages < 2 or not any(e.primitive.name == "pad" for e in prog.eqns):
        return prog
    uses = use_counts(prog)
    # value -> the pads it sums: (pad eqn, block, first row within the block)
    leaves: dict[Any, list[tuple[Any, int, int]]] = {}
    parts: dict[Any, tuple[Any, Any]] = {}
    for e in prog.eqns:
        if e.primitive.name == "pad" and not e.effects:
            where = _row_pad(e, num_stages)
            if where is not None:
                leaves[e.outvars[0]] = [(e, *where)]
        elif e.primitive.name in ("add_any", "add") and len(e.invars) == 2:
            a, b = e.invars
            if isinstance(a, Literal) or isinstance(b, Literal) or a is b:
                continue
            if a in leaves and b in leaves and uses[a] == 1 and uses[b] == 1:
                leaves[e.outvars[0]] = leaves[a] + leaves[b]
                parts[e.outvars[0]] = (a, b)
    absorbed = {p for ab in parts.values() for p in ab}
    roots = {v for v, ls in leaves.items() if v not in absorbed and len({b for _e, b, _r in ls}) > 1}
    if not roots:
        return prog
    dropped: set[Any] = set()  # the roots' sums and pads: made per block instead
    for v in roots:
        work = [v]
        while work:
            x = work.pop()
            dropped.add(x)
            work.extend(parts.get(x, ()))
    splits = dict(prog.splits)
    eqns: list[Any] = []
    for e in prog.eqns:
        out = e.outvars[0] if len(e.outvars) == 1 else None
        if out not in dropped:
            eqns.append(e)
            continue
        if out not in roots:
            continue
        per = int(out.aval.shape[0]) // num_stages
        pieces = [
            _block_sum(e, [(p, r) for p, b, r in leaves[out] if b == j], per, eqns)
            for j in range(num_stages)
        ]
        eqns.append(_concat(pieces, out, e))
        splits[out] = Split(tuple((j * per, (j + 1) * per, j) for j in range(num_stages)), pieces)
    return dataclasses.replace(prog, eqns=eqns, splits=splits)


def _block_sum(root: Any, pads: list[tuple[Any, int]], per: int, eqns: list[Any]) -> Any:
    """One block's piece of the sum ``root`` makes: its ``pads`` (pad eqn, first row in
    the block) re-cut to the block and added, or zeros where none falls in it."""
    out = root.outvars[0]
    aval = out.aval.update(shape=(per, *out.aval.shape[1:]))
    acc = None
    for pad, r in pads:
        x = pad.invars[0]
        rows = int(x.aval.shape[0])
        if (r, rows) != (0, per):
            cfg = ((r, per - r - rows, 0), *pad.params["padding_config"][1:])
            x = _compat.Var(aval)
            eqns.append(pad.replace(outvars=[x], params={**pad.params, "padding_config": cfg}))
        if acc is not None:
            s = _compat.Var(aval)
            eqns.append(root.replace(invars=[acc, x], outvars=[s], source_info=pad.source_info))
            x = s
        acc = x
    if acc is None:  # zeros, made where they are needed (in no task)
        acc = _compat.Var(aval)
        bare = _compat.drop_scopes(root.source_info.name_stack, lambda s: MARKER in s)
        zeros = lambda: jax.numpy.zeros(aval.shape, aval.dtype)  # noqa: E731
        eqns.extend(_traced_eqns(zeros, [], [acc], _compat.with_name_stack(root, bare)))
    return acc


def _row_pad(e: Any, num_stages: int) -> tuple[int, int] | None:
    """(block, first row within it) of a pad with zeros along dim 0 only whose rows lie in
    one of ``num_stages`` equal blocks, in a task on that block's stage (the gradient of
    stage ``s`` reading its own rows of a stage-sharded stack)."""
    cfg = e.params["padding_config"]
    value = e.invars[1]
    if not isinstance(value, Literal) or np.asarray(value.val).any() or not cfg:
        return None
    if any(int(i) != 0 for _l, _h, i in cfg) or any(int(a) or int(b) for a, b, _i in cfg[1:]):
        return None
    n = int(e.outvars[0].aval.shape[0])
    lo, hi = int(cfg[0][0]), int(cfg[0][1])
    if n % num_stages or lo < 0 or hi < 0 or lo + hi >= n:
        return None
    per = n // num_stages
    block = lo // per
    if n - hi > (block + 1) * per:
        return None
    tasks = eqn_tasks(e)  # a virtual stage runs on submesh stage % num_stages
    if not tasks or tasks[-1].stage is None or tasks[-1].stage % num_stages != block:
        return None  # made elsewhere than the block's stage: summed whole, as written
    return block, lo - block * per


def _runs(stages: list[int]) -> Ranges:
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(stages) + 1):
        if i == len(stages) or stages[i] != stages[start]:
            out.append((start, i, stages[start]))
            start = i
    return tuple(out)


def _with_marker(e: Any, name: str, stage: int) -> Any:
    ns = _compat.push_scope(e.source_info.name_stack, f"{name}{MARKER}s{stage}")
    return e.replace(source_info=e.source_info.replace(name_stack=ns))


def _split_scan(e: Any, ref: TaskRef, num_stages: int, eqns: list[Any], splits: dict) -> None:
    params = e.params
    length = int(params["length"])
    assert ref.layers is not None
    ranges = _runs(ref.layers.stages(length, num_stages))
    if len(ranges) <= 1:  # one stage's run of layers, or no layers (a no-op: stage 0)
        eqns.append(_with_marker(e, ref.name, ranges[0][2] if ranges else 0))
        return
    nc, ncar = _compat.scan_counts(params)
    consts = list(e.invars[:nc])
    carry = list(e.invars[nc : nc + ncar])
    xs = list(e.invars[nc + ncar :])
    xs_pieces = [_pieces_of(x, ranges, e, eqns, splits) for x in xs]
    carry_out = list(e.outvars[:ncar])
    ys = list(e.outvars[ncar:])
    ys_pieces: list[list[Any]] = [[None] * len(ranges) for _ in ys]
    order = list(range(len(ranges)))
    if params.get("reverse", False):
        order.reverse()
    cur = carry
    for n, k in enumerate(order):
        a, b, stage = ranges[k]
        last = n == len(order) - 1
        outs_c = carry_out if last else [_compat.Var(v.aval) for v in carry_out]
        outs_y = []
        for j, y in enumerate(ys):
            piece = _compat.Var(y.aval.update(shape=(b - a, *y.aval.shape[1:])))
            ys_pieces[j][k] = piece
            outs_y.append(piece)
        new = e.replace(
            invars=consts + cur + [p[k] for p in xs_pieces],
            outvars=outs_c + outs_y,
            params={**params, "length": b - a},
        )
        eqns.append(_with_marker(new, ref.name, stage))
        cur = [v if not isinstance(v, _compat.DropVar) else _compat.Var(v.aval) for v in outs_c]
    for y, pieces in zip(ys, ys_pieces):
        if isinstance(y, _compat.DropVar):
            continue
        eqns.append(_concat(pieces, y, e))
        splits[y] = Split(ranges, pieces)


def _pieces_of(x: Any, ranges: Ranges, like: Any, eqns: list[Any], splits: dict) -> list[Any]:
    """``x`` cut along axis 0 by ``ranges``: the pieces themselves when ``x`` is a
    concatenation of pieces with those ranges, else static slices."""
    sp = splits.get(x)
    if sp is not None and [r[:2] for r in sp.ranges] == [r[:2] for r in ranges]:
        return list(sp.pieces)
    out = []
    for a, b, _stage in ranges:
        out.append(_slice(x, a, b, like, eqns))
    return out


def _traced_eqns(fn: Any, ins: list[Any], outs: list[Any], like: Any) -> list[Any]:
    """Equations of ``fn`` traced on ``ins``' types, bound to ``ins`` and ``outs``."""
    closed = jax.make_jaxpr(fn)(*[_sds(v.aval) for v in ins])
    env = dict(zip(closed.jaxpr.invars, ins))
    bind = dict(zip(closed.jaxpr.outvars, outs))
    new = []
    for e in closed.jaxpr.eqns:
        args = [a if isinstance(a, Literal) else env[a] for a in e.invars]
        res = []
        for o in e.outvars:
            v = bind.get(o) or _compat.Var(o.aval)
            env[o] = v
            res.append(v)
        new.append(e.replace(invars=args, outvars=res, source_info=like.source_info))
    return new


def _sds(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def _slice(x: Any, a: int, b: int, like: Any, eqns: list[Any]) -> Any:
    out = _compat.Var(x.aval.update(shape=(b - a, *x.aval.shape[1:])))
    eqns.extend(_traced_eqns(lambda v: jax.lax.slice_in_dim(v, a, b, axis=0), [x], [out], like))
    return out


def _sink_slices(eqns: list[Any]) -> list[Any]:
    """Cut element-wise work before it, not after: a piece of ``b1 * mu`` (an optimizer's
    stacked moment, a program argument) becomes ``b1 * piece(mu)``, so each stage reads
    its own rows of the argument (per-stage inputs where it is sharded over the stage
    axis, see :func:`bind_stage_inputs`) instead of the whole value being made on one
    stage and moved. Work whose whole value nothing else reads is then never run (the
    placement only runs what outputs need). Any row cut (``slice`` along axis 0) of
    element-wise work moves up: the same values, less work."""
    producer = {o: e for e in eqns for o in e.outvars}
    out: list[Any] = []

    def rows(x: Any, a: int, b: int, dst: Any, like: Any) -> None:
        e = producer.get(x)
        shape = tuple(x.aval.shape)
        if (
            e is not None
            and e.primitive.name in _ELEMENTWISE
            and len(e.outvars) == 1
            and not e.effects
            and all(
                isinstance(v, Literal) or tuple(v.aval.shape) in ((), shape) for v in e.invars
            )
        ):
            args = []
            for v in e.invars:
                if isinstance(v, Literal) or tuple(v.aval.shape) == ():
                    args.append(v)
                else:
                    piece = _compat.Var(v.aval.update(shape=(b - a, *v.aval.shape[1:])))
                    rows(v, a, b, piece, like)
                    args.append(piece)
            out.append(e.replace(invars=args, outvars=[dst]))
            return
        out.extend(
            _traced_eqns(lambda v: jax.lax.slice_in_dim(v, a, b, axis=0), [x], [dst], like)
        )

    for e in eqns:
        cut = _row_slice(e) if e.primitive.name == "slice" else None
        if cut is not None and e.invars[0] in producer:
            rows(e.invars[0], cut[0], cut[1], e.outvars[0], e)
            continue
        out.append(e)
    return out


def _concat(pieces: list[Any], out: Any, like: Any) -> Any:
    (eqn,) = _traced_eqns(lambda *ps: jax.lax.concatenate(ps, 0), pieces, [out], like)
    return eqn


def _push_through(e: Any, eqns: list[Any], splits: dict) -> bool:
    """Run element-wise work and reductions on split values per piece."""
    prim = e.primitive.name
    if prim == "sharding_constraint":
        if not _leading_unsharded(e):
            return False  # a layout over the stacked (layer) axis: the whole value
    elif prim not in _ELEMENTWISE and prim not in _REDUCTIONS:
        return False
    if len(e.outvars) != 1:
        return False
    split_ins = [splits[a] for a in e.invars if not isinstance(a, Literal) and a in splits]
    if not split_ins:
        return False
    ranges = split_ins[0].ranges
    if any(s.ranges != ranges for s in split_ins):
        return False
    if prim in _REDUCTIONS:
        return _reduce_pieces(
            e, splits[e.invars[0]] if e.invars[0] in splits else None, eqns, splits
        )
    shape = tuple(e.outvars[0].aval.shape)
    for a in e.invars:
        ashape = tuple(getattr(a.aval, "shape", ()))
        if ashape not in ((), shape):
            return False
    pieces = []
    for k, (a, b, _stage) in enumerate(ranges):
        args = []
        for v in e.invars:
            if isinstance(v, Literal) or tuple(v.aval.shape) == ():
                args.append(v)
            elif v in splits:
                args.append(splits[v].pieces[k])
            else:
                args.append(_slice(v, a, b, e, eqns))
        out = e.outvars[0]
        piece = _compat.Var(out.aval.update(shape=(b - a, *out.aval.shape[1:])))
        eqns.append(e.replace(invars=args, outvars=[piece]))
        pieces.append(piece)
    out = e.outvars[0]
    if not isinstance(out, _compat.DropVar):
        eqns.append(_concat(pieces, out, e))
        splits[out] = Split(ranges, pieces)
    return True


def _leading_unsharded(e: Any) -> bool:
    """Whether a sharding constraint leaves dim 0 (the layers) unsharded: it then holds
    per stage's piece (a declared tensor-parallel layout of a stacked parameter)."""
    spec = getattr(e.params.get("sharding"), "spec", None)
    if spec is None or not e.invars or not getattr(e.invars[0].aval, "shape", ()):
        return False
    return len(spec) == 0 or spec[0] is None


def _reduce_pieces(e: Any, sp: Split | None, eqns: list[Any], splits: dict) -> bool:
    if sp is None or len(e.invars) != 1:
        return False
    axes = tuple(e.params.get("axes", ()))
    out = e.outvars[0]
    partial = []
    for a, b, _stage in sp.ranges:
        shape = out.aval.shape if 0 in axes else (b - a, *out.aval.shape[1:])
        p = _compat.Var(out.aval.update(shape=tuple(shape)))
        eqns.append(e.replace(invars=[sp.pieces[len(partial)]], outvars=[p]))
        partial.append(p)
    if 0 not in axes:  # axis 0 kept: the result is split the same way
        eqns.append(_concat(partial, out, e))
        splits[out] = Split(sp.ranges, partial)
        return True
    combine = {"reduce_sum": np.add, "reduce_max": np.maximum, "reduce_min": np.minimum}[
        e.primitive.name
    ]
    fn = {np.add: jax.numpy.add, np.maximum: jax.numpy.maximum, np.minimum: jax.numpy.minimum}[
        combine
    ]

    def fold(*ps: Any) -> Any:
        acc = ps[0]
        for p in ps[1:]:
            acc = fn(acc, p)
        return acc

    eqns.extend(_traced_eqns(fold, partial, [out], e))
    return True


def bind_stage_outputs(
    prog: FlatProgram, num_stages: int, requested: list[Any]
) -> tuple[FlatProgram, dict[int, list[int]]]:
    """Return split outputs (see :func:`stage_outputs`) as their pieces: output ``k`` is
    its first piece and the others are appended; ``assembled[k]`` lists their output
    indices, for the runtime to stack them into one stage-sharded array."""
    outvars = list(prog.outvars)
    assembled: dict[int, list[int]] = {}
    for k, sp in stage_outputs(prog, num_stages).items():
        if requested[k] is not None:  # out_shardings asked for something else
            continue
        outvars[k] = sp.pieces[0]
        idxs = [k]
        for p in sp.pieces[1:]:
            outvars.append(p)
            idxs.append(len(outvars) - 1)
        assembled[k] = idxs
    if not assembled:
        return prog, {}
    return dataclasses.replace(prog, outvars=outvars), assembled


def stage_outputs(prog: FlatProgram, num_stages: int) -> dict[int, Split]:
    """Program outputs that are split one range per stage, in stage order, with equal
    lengths: they can be returned sharded over the stage axis."""
    out: dict[int, Split] = {}
    for k, v in enumerate(prog.outvars):
        sp = prog.splits.get(v) if not isinstance(v, Literal) else None
        if sp is None or len(sp.ranges) != num_stages:
            continue
        lens = {b - a for a, b, _s in sp.ranges}
        if len(lens) == 1 and [s for _a, _b, s in sp.ranges] == list(range(num_stages)):
            out[k] = sp
    return out


@dataclasses.dataclass(frozen=True)
class InputPiece:
    """A program input that is one stage's rows of a stage-sharded argument."""

    arg: int  # flat argument index
    start: int
    stop: int
    stage: int  # target index


def bind_stage_inputs(
    prog: FlatProgram,
    shardings: list[Any],
    stage_axis: str | None,
    targets: list[Any],
    requested: list[Any] | None = None,
) -> tuple[FlatProgram, dict[int, InputPiece], list[int]]:
    """Arguments sharded over the stage axis (dim 0, stage-major) whose rows the program
    slices per stage: each stage's rows become a program input of their own, taken from
    the argument's shards on that stage (no copy). A slice of rows within one stage's
    (``ws[i]`` of a stacked weight) reads them there. Such an argument returned as is
    (``requested[k]`` None: no ``out_shardings``) is returned as its pieces, assembled
    into one stage-sharded array like the outputs of :func:`bind_stage_outputs`, in
    the argument's own layout (not gathered whole onto a submesh)."""
    keep_all = list(range(len(prog.eqns)))
    if stage_axis is None:
        return prog, {}, keep_all
    by_devs = {frozenset(t.device_ids): t for t in targets}
    rows: dict[Any, dict[tuple[int, int], int]] = {}  # invar -> (start, stop) -> target
    for v, sh in zip(prog.invars, shardings):
        r = _stage_rows(sh, stage_axis, by_devs, v.aval.shape)
        if r:
            rows[v] = r
    if not rows:
        return prog, {}, keep_all
    arg_of = {v: i for i, v in enumerate(prog.invars)}
    eqns, invars, pieces, keep = [], list(prog.invars), {}, []
    bound: dict[tuple[Any, int, int], Any] = {}  # (argument, start, stop) -> its input

    def bind(v: Any, a: int, b: int, t: int, var: Any = None) -> Any:
        if (v, a, b) not in bound:
            if var is None:
                var = _compat.Var(v.aval.update(shape=(b - a, *v.aval.shape[1:])))
            invars.append(var)
            pieces[len(invars) - 1] = InputPiece(arg_of[v], a, b, t)
            bound[(v, a, b)] = var
        return bound[(v, a, b)]

    for idx, e in enumerate(prog.eqns):
        if e.primitive.name == "slice" and e.invars[0] in rows:
            cut = _row_slice(e)
            block = _block_of(rows[e.invars[0]], cut) if cut is not None else None
            if block is not None:
                (a, b), t = block
                if cut == (a, b) and (e.invars[0], a, b) not in bound:
                    bind(e.invars[0], a, b, t, e.outvars[0])  # the slice is the input
                    continue
                piece = bind(e.invars[0], a, b, t)
                p = e.params
                start = (cut[0] - a, *tuple(p["start_indices"])[1:])
                limit = (cut[1] - a, *tuple(p["limit_indices"])[1:])
                e = e.replace(
                    invars=[piece], params={**p, "start_indices": start, "limit_indices": limit}
                )
        eqns.append(e)
        keep.append(idx)
    splits = dict(prog.splits)
    for k, v in enumerate(prog.outvars):
        if v in rows and (requested is None or k >= len(requested) or requested[k] is None):
            ranges = tuple((a, b, t) for (a, b), t in sorted(rows[v].items()))
            splits[v] = Split(ranges, [bind(v, a, b, t) for a, b, t in ranges])
    if not pieces:
        return prog, {}, keep_all
    return dataclasses.replace(prog, eqns=eqns, invars=invars, splits=splits), pieces, keep


def _block_of(
    blocks: dict[tuple[int, int], int], cut: tuple[int, int]
) -> tuple[tuple[int, int], int] | None:
    """The stage's rows (and its target) holding rows ``cut``, if one does."""
    for (a, b), t in blocks.items():
        if a <= cut[0] and cut[1] <= b and cut[0] < cut[1]:
            return (a, b), t
    return None


def _stage_rows(sh: Any, stage_axis: str, by_devs: dict, shape: tuple[int, ...]) -> dict:
    """(start, stop) -> target of each stage's rows of an argument sharded over the stage
    axis on dim 0, where each target's devices hold exactly those rows in the layout
    :func:`piece_spec` gives on its mesh (else ``{}``: the argument is put)."""
    from jax.sharding import NamedSharding

    if not isinstance(sh, NamedSharding) or stage_axis not in sh.mesh.axis_names or not shape:
        return {}
    spec = tuple(sh.spec)
    first = spec[0] if spec else None
    axes = (first,) if isinstance(first, str) else tuple(first or ())
    if not axes or axes[0] != stage_axis:
        return {}
    mesh = sh.mesh
    dim = tuple(mesh.axis_names).index(stage_axis)
    n_stages = mesh.devices.shape[dim]
    if shape[0] % n_stages:
        return {}
    per = shape[0] // n_stages
    held = sh.devices_indices_map(shape)
    out = {}
    for j in range(n_stages):
        devs = frozenset(int(d.id) for d in np.take(mesh.devices, [j], axis=dim).flat)
        t = by_devs.get(devs)
        if t is None:
            return {}
        try:
            piece = NamedSharding(t.mesh, piece_spec(sh, stage_axis))
            want = piece.devices_indices_map((per, *shape[1:]))
        except (ValueError, KeyError):  # the submesh lacks the spec's axes
            return {}
        for d, idx in want.items():
            rows = _bounds(idx, (per, *shape[1:]))
            rows[0] = (rows[0][0] + j * per, rows[0][1] + j * per)
            if d not in held or _bounds(held[d], shape) != rows:
                return {}  # the submesh's devices in another order or shape
        out[(j * per, (j + 1) * per)] = t.index
    return out


def _bounds(idx: tuple[Any, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    out = []
    for k, n in enumerate(shape):
        s = idx[k] if k < len(idx) else slice(None)
        a, b, _ = s.indices(n)
        out.append((a, b))
    return out


def _row_slice(e: Any) -> tuple[int, int] | None:
    p = e.params
    start, limit = tuple(p["start_indices"]), tuple(p["limit_indices"])
    strides = p.get("strides")
    shape = tuple(e.invars[0].aval.shape)
    if strides is not None and any(s != 1 for s in strides):
        return None
    if any(a != 0 or b != n for a, b, n in zip(start[1:], limit[1:], shape[1:])):
        return None
    return int(start[0]), int(limit[0])


def piece_spec(sh: Any, stage_axis: str) -> Any:
    """The spec of one stage's rows of a stage-sharded argument, on its submesh."""
    from jax.sharding import PartitionSpec

    spec = list(sh.spec)
    first = spec[0]
    rest = tuple(a for a in ((first,) if isinstance(first, str) else first) if a != stage_axis)
    spec[0] = rest[0] if len(rest) == 1 else (rest or None)
    return PartitionSpec(*spec)


def stage_sharding(global_mesh: Any, piece_sh: Any, stage_axis: str) -> Any:
    """The global sharding of pieces stacked along dim 0 in stage order."""
    from jax.sharding import NamedSharding, PartitionSpec

    spec = list(piece_sh.spec) or [None]
    first = spec[0]
    inner = () if first is None else ((first,) if isinstance(first, str) else tuple(first))
    spec[0] = (stage_axis, *inner) if inner else stage_axis
    return NamedSharding(global_mesh, PartitionSpec(*spec))
