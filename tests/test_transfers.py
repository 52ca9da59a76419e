"""Small values that move between the same submeshes at the same point move as one."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import assert_close
from flax import nnx

import multimesh as mm
from multimesh.examples import gpt


def transformer_step():
    cfg = gpt.Config(stages=4, layers=4)
    model = gpt.GPT(cfg, nnx.Rngs(0))
    lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 50)
    # eps: the key bias of attention has a zero gradient (softmax is shift invariant);
    # Adam with a tiny eps would amplify rounding noise there into +-lr steps
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, eps=1e-4))
    step, state = gpt.nnx_train_step(cfg, model, opt, 2)
    return cfg, step, state


def test_scalars_are_packed_and_values_match(mesh4x2):
    cfg, step, state = transformer_step()
    tokens = gpt.synthetic_batch(cfg, 8)
    f = mm.jit(step, mesh=mesh4x2)
    plan = f.lower(state, tokens).plan
    small = [t for t in plan.transfers if np.prod(t.shape) <= 64]
    # a MaxText-like step (gradient clipping, a learning-rate schedule) moves ~45 scalars;
    # packed, each fragment sends at most one small array per destination and dtype
    assert sum(t.values for t in small) >= 40
    groups = collections.Counter((t.after, t.dst_stage, t.dtype) for t in small)
    assert max(groups.values()) == 1, plan.as_text()
    assert len(plan.transfers) <= 24, plan.as_text()
    assert "values packed" in plan.as_text()
    s, ref_s = state, state
    with mesh4x2:
        ref = jax.jit(step)
    for _ in range(2):
        s, loss = f(s, tokens)
        with mesh4x2:
            ref_s, ref_loss = ref(ref_s, tokens)
        assert_close(loss, ref_loss, rtol=1e-5)
    assert_close(s, ref_s, rtol=1e-4, atol=1e-5)


def test_packing_keeps_dtypes_and_weak_types(mesh4x2):
    def f(x, s):
        with mm.task("a", stage=0):
            ints = [jnp.sum(x * i).astype(jnp.int32) for i in range(3)]
            floats = [jnp.sum(x + i) for i in range(3)]
            weak = [s * i for i in range(1, 3)]  # weak-typed: s is a Python float
            vec = x[:3] * 2
        with mm.task("b", stage=1):
            return sum(ints) + 1, sum(floats) * 2, weak[0] + weak[1], vec + 1, floats[0]

    x = jnp.arange(8.0)
    s = jax.device_put(1.5, jax.sharding.NamedSharding(mesh4x2.submesh(0), jax.P()))
    assert s.weak_type
    g = mm.jit(f, mesh=mesh4x2)
    plan = g.lower(x, s).plan
    # int32 x3 | float32 x3 + the 3-vector | weak float32 x2
    assert sorted(t.values for t in plan.transfers) == [2, 3, 4], plan.as_text()
    with mesh4x2:
        want = jax.jit(f)(x, 1.5)
    got = g(x, s)
    assert_close(got, want)
    assert [a.dtype for a in got] == [a.dtype for a in want]


def test_many_small_values_go_in_packs_of_bounded_size(mesh4x2):
    """Hundreds of scalars crossing at one point go in packs of at most MAX_VALUES: one
    pack of them all took XLA minutes to compile (quadratic in the slices of a buffer)."""
    from multimesh.compiler import pack

    n = pack.MAX_VALUES * 2 + 5

    def f(x):
        with mm.task("a", stage=0):
            vals = [jnp.sum(x) * i for i in range(n)]
        with mm.task("b", stage=1):
            return sum(v * (i % 3) for i, v in enumerate(vals))

    x = jnp.arange(4.0)
    g = mm.jit(f, mesh=mesh4x2)
    plan = g.lower(x).plan
    assert sorted(t.values for t in plan.transfers) == [5, pack.MAX_VALUES, pack.MAX_VALUES]
    with mesh4x2:
        want = jax.jit(f)(x)
    assert_close(g(x), want)


def test_key_arguments_move_as_their_data(monkeypatch):
    """Multi-process runs move key arguments as their data too (a fragment of their own
    unwraps them where they live): forced here in one process, values and keys are
    jax.jit's over calls feeding the key back (the multi-process tier runs it across
    processes)."""
    from multimesh.compiler import keys

    orig = keys.keys_as_data
    monkeypatch.setattr(keys, "keys_as_data", lambda *a, **k: orig(*a, **{**k, "inputs": True}))
    mmesh = mm.make_mesh((2, 4), ("stage", "data"))

    def f(k, x):
        with mm.task("a", stage=1):
            k, s = jax.random.split(k)
            y = x * jax.random.uniform(s, x.shape)
        with mm.task("b", stage=0):
            k2 = jax.random.fold_in(k, 1)
            return y + jax.random.uniform(k2, x.shape), k2

    g, ref = mm.jit(f, mesh=mmesh), jax.jit(f)
    x = jnp.ones(8)
    a = b = (None, jax.random.key(0))
    for _ in range(3):
        a, b = g(a[1], x), ref(b[1], x)
        assert_close(a[0], b[0])
        np.testing.assert_array_equal(jax.random.key_data(a[1]), jax.random.key_data(b[1]))
    plan = g.lower(a[1], x).plan
    assert all("key" not in t.dtype for t in plan.transfers), plan.as_text()
