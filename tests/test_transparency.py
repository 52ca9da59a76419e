"""Tasks are transparent outside mm.jit; ambient mesh contexts; thread safety."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, reference

import multimesh as mm


def model(w, x):
    with mm.task("l0", stage=0):
        h = jnp.tanh(x @ w)
    with mm.task("l1", stage=1):
        y = h * 2
    return jnp.mean(y**2)


W = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)
X = jnp.linspace(0.0, 2.0, 32).reshape(8, 4)


def plain(w, x):  # the same model without tasks
    return jnp.mean((jnp.tanh(x @ w) * 2) ** 2)


def test_tasks_run_without_multimesh_eagerly_and_under_jit():
    want = plain(W, X)
    assert_close(model(W, X), want)
    one_device = jax.jit(model)(W, X)
    assert_close(one_device, want)
    assert len(one_device.sharding.device_set) == 1
    assert_close(jax.grad(model)(W, X), jax.grad(plain)(W, X))
    assert_close(jax.vmap(model, in_axes=(None, 0))(W, X[None]), plain(W, X)[None])
    assert_close(jax.jit(jax.value_and_grad(model))(W, X), jax.value_and_grad(plain)(W, X))


def test_decorator_and_function_forms_transparent():
    @mm.task(stage=3)
    def f(x):
        return x + 1

    g = mm.task(lambda x: x * 2, name="g", stage=7)
    assert_close(jax.jit(lambda x: g(f(x)))(X), (X + 1) * 2)


def test_microbatch_reference_without_multimesh():
    grad_fn = mm.microbatch(jax.value_and_grad(model), 4, argnums=1, reduce="mean")
    assert_close(jax.jit(grad_fn)(W, X), jax.value_and_grad(plain)(W, X), rtol=1e-5)


def test_under_multimesh_reference_is_global_spmd(mesh4x2):
    with mesh4x2:
        out = jax.jit(model)(W, X)
    assert len(out.sharding.device_set) == 8
    assert_close(out, plain(W, X))


def test_stage_task_under_mm_jit_without_mesh_is_an_error():
    with pytest.raises(ValueError, match=r"task 'l0': stage=0 needs a MultiMesh under mm.jit"):
        mm.jit(model)(W, X)


def test_virtual_stages_transparent_under_an_active_multimesh(mesh4x2):
    """An interleaved model (virtual stages 0..7 on 4 submeshes) evaluated outside its
    microbatch loop under `with mmesh:`: eagerly and under jax.jit (was "out of range");
    under mm.jit outside an interleaved loop it stays a clear error."""

    def deep(w, x):
        for i in range(8):
            with mm.task(f"v{i}", stage=i):
                x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    def deep_plain(w, x):
        for _ in range(8):
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    want = jax.value_and_grad(deep_plain)(W, X)
    with mesh4x2:
        assert_close(deep(W, X), want[0])
        assert_close(jax.jit(jax.value_and_grad(deep))(W, X), want)
    with pytest.raises(ValueError, match=r"task 'v4': stage=4 is out of range"):
        mm.jit(deep, mesh=mesh4x2)(W, X)


def test_out_of_range_stage_from_cached_trace(mesh4x2):
    @jax.jit
    def inner(x):
        with mm.task("far", stage=9):
            return x + 1

    inner(X)  # traced (and cached) transparently, without a MultiMesh
    with pytest.raises(ValueError, match=r"task 'far': stage=9 is out of range"):
        mm.jit(lambda x: inner(x), mesh=mesh4x2)(X)


@pytest.mark.parametrize("ctx", ["multimesh", "set_mesh", "use_mesh"])
def test_ambient_mesh_contexts(mesh4x2, ctx):
    if ctx == "use_mesh" and not hasattr(jax.sharding, "use_mesh"):
        pytest.skip("jax.sharding.use_mesh is not in this JAX version")
    cm = {
        "multimesh": lambda: mesh4x2,
        "set_mesh": lambda: jax.set_mesh(mesh4x2.mesh),
        "use_mesh": lambda: jax.sharding.use_mesh(mesh4x2.mesh),
    }[ctx]
    step = mm.jit(jax.value_and_grad(model), mesh=mesh4x2)
    want = reference(jax.value_and_grad(model), mesh4x2, W, X)
    with cm():
        got = step(W, X)
        compiled = step.lower(W, X).compile()
        again = compiled(W, X)
    assert_close(got, want)
    assert_close(again, want)
    # mm.jit without mesh= takes the active MultiMesh
    with mesh4x2:
        assert_close(mm.jit(model)(W, X), want[0])


def test_with_multimesh_in_threads(mesh4x2):
    step = mm.jit(model, mesh=mesh4x2)
    step(W, X)  # compile once
    errors, results = [], []
    barrier = threading.Barrier(4)

    def work():
        try:
            barrier.wait()
            for _ in range(5):
                with mesh4x2:
                    results.append(float(step(W, X)))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(results) == 20 and np.allclose(results, float(plain(W, X)))


def test_decorated_task_traced_by_threads():
    @mm.task(stage=0)
    def layer(x):
        return jnp.sin(x) * 3

    errors, results = [], []
    barrier = threading.Barrier(4)

    def work(k):
        try:
            barrier.wait()
            for j in range(5):
                # a new shape each time: traced concurrently
                x = jnp.ones((k + 1, j + 1))
                results.append(float(jax.jit(layer)(x).sum()))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(results) == 20


def test_task_name_from_function(mesh4x2):
    @mm.task(stage=1)
    def head(x):
        return x * 2

    lowered = mm.jit(head, mesh=mesh4x2).lower(X)
    assert [f.tasks for f in lowered.plan.fragments] == [("head",)]
    with pytest.raises(TypeError, match="needs a name when used as a context manager"):
        with mm.task(stage=0):
            pass


def test_microbatch_outputs_holding_none(mesh4x2):
    """``None`` in a microbatched function's outputs (``has_aux`` with ``aux=None``, a
    dict entry) stays ``None``: eagerly, under jax.jit and under mm.jit alike (found by a
    probe: the reference scan called ``.astype`` on it)."""
    w, x = jnp.eye(4), jnp.ones((4, 4))

    def loss(w, x):
        with mm.task("a", stage=0):
            h = x @ w
        return jnp.sum(h), {"none": None, "n": jnp.sum(h > 0)}

    g = mm.microbatch(jax.value_and_grad(loss, has_aux=True), 2, argnums=1)
    want = [16.0, 16, 4 * np.ones((4, 4))]  # summed over 2 microbatches of 2 rows
    for got in (g(w, x), jax.jit(g)(w, x), mm.jit(g, mesh=mesh4x2)(w, x)):
        (val, aux), grad = got
        assert aux["none"] is None
        for a, b in zip([val, aux["n"], grad], want):
            np.testing.assert_allclose(np.asarray(a), b)


def test_a_pallas_kernel_in_a_task(mesh222):
    """A Pallas kernel (interpreted: any backend) inside a task: its references' types
    are rewritten for the submesh like any value's (it failed with AbstractRef's
    "unexpected keyword argument 'sharding'")."""
    from jax.experimental import pallas as pl

    def kern(x_ref, o_ref):
        o_ref[...] = jnp.sin(x_ref[...]) * 2

    def f(x):
        with mm.task("a", stage=0):
            out = jax.ShapeDtypeStruct(x.shape, x.dtype)
            h = pl.pallas_call(kern, out_shape=out, interpret=True)(x)
        with mm.task("b", stage=1):
            return (h + 1).sum(axis=0)

    x = np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8)
    assert_close(mm.jit(f, mesh=mesh222)(x), jax.jit(f)(x), rtol=1e-6)
