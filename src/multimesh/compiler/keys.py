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
    prog: FlatProgram, labels: Labels, placement: Placement, frags: list[Fragment]
) -> tuple[FlatProgram, Labels, Placement, list[Fragment]]:
    """Move every key a fragment sends to another submesh as its key data."""
    made_in = producers(prog, frags)
    todo = [t for t in placement.transfers if is_key(t[0].aval) and (t[0], t[1]) in made_in]
    if not todo:
        return prog, labels, placement, frags
    ed = ProgramEdit(prog, labels, placement, frags)
    producer_eqn = {o: i for i, e in enumerate(prog.eqns) for o in e.outvars}
    data_of: dict[tuple[Any, int], Any] = {}  # (key, src) -> its data there
    moved: set[tuple[Any, int]] = set()
    new_transfers: list[tuple[Any, int, int]] = []
    for v, src, dst in todo:
        k = made_in[(v, src)]
        data = data_of.get((v, src))
        if data is None:
            closed = jax.make_jaxpr(jax.random.key_data)(sds(v.aval))
            eqns, env = instantiate(
                closed, {closed.jaxpr.invars[0]: v}, {}, prog.eqns[producer_eqn[v]]
            )
            ed.frags[k].eqns.extend(ed.add(eqns, producer_eqn[v], src))
            data = data_of[(v, src)] = env[closed.jaxpr.outvars[0]]
        new_transfers.append((data, src, dst))
        moved.add((v, dst))
        first = ed.first_user({v}, dst, k)
        impl = _compat.key_impl(v.aval.dtype)
        closed = jax.make_jaxpr(lambda d, impl=impl: jax.random.wrap_key_data(d, impl=impl))(
            sds(data.aval)
        )
        eqns, _env = instantiate(
            closed,
            {closed.jaxpr.invars[0]: data},
            {closed.jaxpr.outvars[0]: v},
            ed.like(first, prog.eqns[producer_eqn[v]]),
        )
        # untagged: it runs on dst, with the consumer's name stack (its phase)
        ed.frags[first].eqns[:0] = ed.add(eqns, None, dst)
    transfers = [t for t in placement.transfers if (t[0], t[2]) not in moved] + new_transfers
    return ed.result(transfers, dict(placement.packed))
