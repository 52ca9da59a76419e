"""The conditional passes alone: ``split_conds`` (per group, per group and phase) and
``merge_conds`` (conds on one predicate joined per fragment), checked by evaluating the
rewritten programs against the originals for every branch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from jax.experimental import io_callback

import multimesh as mm
from multimesh import _compat
from multimesh.compiler import conds, inline


def _eval(prog, *args):
    jaxpr = _compat.make_jaxpr_obj(prog.invars, prog.outvars, prog.eqns)
    jaxpr = jaxpr.replace(constvars=prog.constvars)
    return jax.core.eval_jaxpr(jaxpr, prog.consts, *args)


def _num_conds(eqns):
    return sum(e.primitive.name == "cond" for e in eqns)


def _clipped(a, b, c):
    """A global-norm clip of two leaves under a cond: the groups meet in one scalar."""

    def apply(a, b, c):
        n = jnp.sqrt(jnp.sum(a**2) + jnp.sum(b**2))
        s = jnp.minimum(1.0, 0.5 / n)
        return a * s - 0.1 * c[0], b * s + c[1], c + 1.0

    def skip(a, b, c):
        return jnp.zeros_like(a), b, c

    return jax.lax.cond(c[0] > 0, apply, skip, a, b, c)


@pytest.mark.parametrize("flag", [1.0, -1.0])
def test_phase_split_matches_the_cond(flag):
    a = jnp.arange(12.0).reshape(3, 4) / 7
    b = jnp.ones((4, 3)) * 0.3
    c = jnp.array([flag, 2.0])
    closed = jax.make_jaxpr(_clipped)(a, b, c)
    prog = inline.flatten(closed)
    split = conds.split_conds(prog)
    # per leaf: sums of squares, then the norm (scalars), then the scaled leaves
    assert _num_conds(split.eqns) > 3
    for e in split.eqns:
        if e.primitive.name == "cond":  # no cond reads both large leaves
            assert not {id(a) for a in prog.invars[:2]} <= {id(v) for v in e.invars}
    assert_close(_eval(split, a, b, c), list(_clipped(a, b, c)), rtol=1e-6)
    merged = conds.merge_conds(split.eqns)
    assert _num_conds(merged) < _num_conds(split.eqns)
    prog2 = split.__class__(split.invars, split.constvars, split.consts, split.outvars, merged)
    assert_close(_eval(prog2, a, b, c), list(_clipped(a, b, c)), rtol=1e-6)


def test_merge_joins_independent_conds_only():
    def f(p, x, y):
        u = jax.lax.cond(p, lambda x: x * 2, lambda x: x - 1, x)
        v = jax.lax.cond(p, lambda y: jnp.sin(y), lambda y: y, y)
        w = jax.lax.cond(p, lambda u: u + 3, lambda u: u * u, u + v)  # reads both
        return u, v, w

    args = (True, jnp.arange(4.0), jnp.ones(4))
    prog = inline.flatten(jax.make_jaxpr(f)(*args))
    # one predicate variable for the three (as split_conds leaves them)
    pred = next(e.invars[0] for e in prog.eqns if e.primitive.name == "cond")
    prog.eqns = [
        e.replace(invars=[pred, *e.invars[1:]]) if e.primitive.name == "cond" else e
        for e in prog.eqns
    ]
    merged = conds.merge_conds(prog.eqns)
    assert _num_conds(prog.eqns) == 3 and _num_conds(merged) == 2
    for p in (True, False):
        got = _eval(
            prog.__class__(prog.invars, prog.constvars, prog.consts, prog.outvars, merged),
            p,
            *args[1:],
        )
        assert_close(got, list(f(p, *args[1:])))


def test_keys_are_not_phase_split():
    """A cond making PRNG keys keeps its form (no zeros stand in for a key)."""

    def f(p, a, b, k):
        def yes(a, b, k):
            n = jnp.sum(a) + jnp.sum(b)
            return a * n, b * n, jax.random.fold_in(k, (n > 0).astype(jnp.int32))

        return jax.lax.cond(p, yes, lambda a, b, k: (a, b, k), a, b, k)

    args = (True, jnp.ones((2, 2)), jnp.ones((3,)), jax.random.key(0))
    prog = inline.flatten(jax.make_jaxpr(f)(*args))
    assert conds.split_conds(prog).eqns == prog.eqns


def test_optax_clip_cond_values():
    """optax.apply_if_finite(chain(clip_by_global_norm, adam)) through both passes."""
    tx = optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)), 2)
    params = {"a": jnp.ones((3, 4)), "b": jnp.full((5,), 0.5)}
    state = tx.init(params)

    def step(g, s, p):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for grads in (
        jax.tree.map(lambda x: x * 3.0, params),
        {"a": params["a"] * np.nan, "b": params["b"]},
    ):
        closed = jax.make_jaxpr(step)(grads, state, params)
        prog = conds.split_conds(inline.flatten(closed))
        prog = prog.__class__(
            prog.invars, prog.constvars, prog.consts, prog.outvars, conds.merge_conds(prog.eqns)
        )
        flat = jax.tree.leaves((grads, state, params))
        want = jax.tree.leaves(step(grads, state, params))
        assert_close(_eval(prog, *flat), want, rtol=1e-6)


def test_merge_keeps_ordered_effects_in_order(mesh4x2):
    """The forward and backward conds of a linear cond share a predicate; joining them
    reordered the fragment, and an ordered callback reading the cond's output ran after
    one that comes later in the program (effects now keep their order)."""
    log = []

    def cb(tag):
        def f(v):
            log.append(tag)
            return np.asarray(v)

        return f

    def loss(x, p):
        a = jax.lax.cond(p > 0, lambda x: 2 * x, lambda x: -x, x)
        sds = jax.ShapeDtypeStruct(x.shape, x.dtype)
        n = io_callback(cb("N"), sds, jax.lax.stop_gradient(a), ordered=True)
        e = io_callback(cb("E"), sds, jax.lax.stop_gradient(x), ordered=True)
        return jnp.sum(a * e) + jnp.sum(n)

    x, p = jnp.arange(4.0), jnp.array(1.0)
    g = jax.block_until_ready(mm.jit(jax.grad(loss), mesh=mesh4x2)(x, p))
    assert log == ["N", "E"]
    assert_close(g, 2 * x)
