"""Keys as data: a typed PRNG key moves between submeshes as its key data.

A typed key (``jax.random.key``) is an array of an extended dtype. Copies between
devices of one process take it, but the transports between processes move plain
buffers, and the fast same-layout copy does not apply to it either. So each key a
fragment sends to another submesh is unwrapped (``jax.random.key_data``) at the end of
the fragment making it, moved as its ``uint32`` data (packed with other small values),
and wrapped again (same implementation) at the start of the first fragment using it on
the destination. A pure function over plain data, like packing.
"""

from __future__ import annotations

from typing import Any

import jax

from multimesh import _compat
from multimesh.compiler.fragment import Fragment
from multimesh.compiler.ir import FlatProgram, Labels, Placement
from multimesh.compiler.pack import ProgramEdit, instantiate, producers, sds

_compat.register_exclusion(__file__)


def is_key(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def keys_as_data(
    prog: FlatProgram,
    labels: Labels,
    placement: Placement,
    frags: list[Fragment],
    inputs: bool = False,
) -> tuple[FlatProgram, Labels, Placement, list[Fragment]]:
    """Move every key a fragment sends to another submesh as its key data; with
    ``inputs`` (multi-process runs), also key arguments moved from the submesh they
    live on (a fragment of their own there unwraps them, first)."""
    made_in = producers(prog, frags)
    todo = [
        t
        for t in placement.transfers
        if is_key(t[0].aval)
        and ((t[0], t[1]) in made_in or (inputs and t[0] in placement.input_stages))
    ]
    if not todo:
        return prog, labels, placement, frags
    ed = ProgramEdit(prog, labels, placement, frags)
    producer_eqn = {o: i for i, e in enumerate(prog.eqns) for o in e.outvars}
    reader_eqn = {
        a: i
        for i, e in reversed(list(enumerate(prog.eqns)))
        for a in e.invars
        if not isinstance(a, _compat.Literal)
    }
    # the fragments making each key on its source: its producer, or (an argument) one
    # at the front of the plan on the submesh it lives on
    source: dict[tuple[Any, int], Fragment] = {}
    front: dict[int, Fragment] = {}  # stage -> the fragment unwrapping arguments there
    for v, src, _dst in todo:
        if (v, src) in made_in:
            source[(v, src)] = ed.frags[made_in[(v, src)]]
        elif src not in front:
            front[src] = Fragment(stage=src, level=0, eqns=[])
            ed.frags.insert(0, front[src])
    for v, src, _dst in todo:
        source.setdefault((v, src), front.get(src))  # type: ignore[arg-type]
    data_of: dict[tuple[Any, int], Any] = {}  # (key, src) -> its data there
    moved: set[tuple[Any, int]] = set()
    new_transfers: list[tuple[Any, int, int]] = []
    for v, src, dst in todo:
        frag = source[(v, src)]
        like = producer_eqn.get(v, reader_eqn.get(v))
        data = data_of.get((v, src))
        if data is None:
            closed = jax.make_jaxpr(jax.random.key_data)(sds(v.aval))
            eqns, env = instantiate(closed, {closed.jaxpr.invars[0]: v}, {}, prog.eqns[like])
            made = v in producer_eqn and (v, src) in made_in
            frag.eqns.extend(ed.add(eqns, like if made else None, src))
            data = data_of[(v, src)] = env[closed.jaxpr.outvars[0]]
        new_transfers.append((data, src, dst))
        moved.add((v, dst))
        k = next(j for j, f in enumerate(ed.frags) if f is frag)
        first = ed.first_user({v}, dst, k)
        impl = _compat.key_impl(v.aval.dtype)
        closed = jax.make_jaxpr(lambda d, impl=impl: jax.random.wrap_key_data(d, impl=impl))(
            sds(data.aval)
        )
        eqns, _env = instantiate(
            closed,
            {closed.jaxpr.invars[0]: data},
            {closed.jaxpr.outvars[0]: v},
            ed.like(first, prog.eqns[like]),
        )
        # untagged: it runs on dst, with the consumer's name stack (its phase)
        ed.frags[first].eqns[:0] = ed.add(eqns, None, dst)
    transfers = [t for t in placement.transfers if (t[0], t[2]) not in moved] + new_transfers
    return ed.result(transfers, dict(placement.packed))
