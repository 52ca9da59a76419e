"""JAX's switches and caches act on mm.jit functions as on jax.jit ones:
``jax.disable_jit``, ``jax_debug_nans``/``jax_debug_infs``, ``jax.clear_caches``,
``copy.deepcopy``, an mm.jit function called inside another, and tracing errors that
name the user's function and arguments."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import multimesh as mm


def two_stage(x, s):
    with mm.task("a", stage=0):
        h = jnp.sin(x) * s
    with mm.task("b", stage=1):
        return jnp.log(h) + 1.0


def test_disable_jit_runs_the_function_as_python(mesh4x2):
    traced = []

    def f(x, n):
        traced.append(type(x).__name__)
        with mm.task("a", stage=0):
            h = x * n
        with mm.task("b", stage=1):
            return h + 1.0

    g = mm.jit(f, mesh=mesh4x2, static_argnums=1, donate_argnums=0)
    x = jnp.arange(4.0)
    with jax.disable_jit():
        got = g(x, 3)
    assert traced == ["ArrayImpl"]  # run eagerly, on concrete values
    assert not x.is_deleted()  # as jax.jit: no donation without jit
    np.testing.assert_array_equal(got, np.arange(4.0) * 3 + 1)
    np.testing.assert_array_equal(g(jnp.arange(4.0), 3), got)  # and compiled afterwards
    assert traced[-1] != "ArrayImpl"


def test_debug_nans_names_the_operation(mesh4x2):
    f = mm.jit(two_stage, mesh=mesh4x2)
    x = jnp.array([0.5, -0.5])  # log of a negative: NaN made on stage 1
    with jax.debug_nans(True):
        with pytest.raises(FloatingPointError, match=r"invalid value \(nan\) encountered in log"):
            f(x, 2.0)
        np.testing.assert_allclose(f(jnp.array([0.5, 0.25]), 2.0), jax.jit(two_stage)(
            jnp.array([0.5, 0.25]), 2.0), rtol=1e-6)  # finite: runs
    assert np.isnan(np.asarray(f(x, 2.0))[1])  # without the check: NaN, as jax.jit


def test_debug_infs_checks_outputs_only_as_jax_jit(mesh4x2):
    def f(x):
        with mm.task("a", stage=0):
            h = -1.0 / x  # -inf between the tasks
        with mm.task("b", stage=1):
            return jnp.exp(h)  # 0: finite

    x = jnp.array([0.0, 1.0])
    with jax.debug_infs(True):
        want = jax.jit(f)(x)  # jax.jit checks its outputs only
        np.testing.assert_array_equal(mm.jit(f, mesh=mesh4x2)(x), want)


def test_debug_nans_with_donated_arguments_says_why(mesh4x2):
    f = mm.jit(two_stage, mesh=mesh4x2, donate_argnums=0)
    with jax.debug_nans(True):
        with pytest.raises(FloatingPointError, match="donated arguments are gone"):
            f(jnp.array([0.5, -0.5]), 2.0)


def test_clear_caches_clears_mm_jit(mesh4x2):
    n = []

    def f(x):
        n.append(1)
        return two_stage(x, 2.0)

    g = mm.jit(f, mesh=mesh4x2)
    g(jnp.ones(2))
    g(jnp.ones(2))
    assert len(n) == 1 and g._cache_size() == 1
    jax.clear_caches()
    assert g._cache_size() == 0
    np.testing.assert_allclose(g(jnp.ones(2)), jax.jit(f)(jnp.ones(2)), rtol=1e-6)
    assert len(n) == 3  # traced again (jax.jit's reference call traced once more)


def test_deepcopy_keeps_functions_and_meshes(mesh4x2):
    g = mm.jit(two_stage, mesh=mesh4x2)
    cfg = copy.deepcopy({"step": g, "mesh": mesh4x2})
    assert cfg["step"] is g and cfg["mesh"] is mesh4x2


def test_mm_jit_inside_mm_jit_is_one_program(mesh4x2):
    inner = mm.jit(two_stage, mesh=mesh4x2, static_argnums=1)

    def outer(x):
        with mm.task("c", stage=2):
            y = x * 2.0
        return inner(y, 3.0) * 2.0

    def reference(x):
        with mm.task("c", stage=2):
            y = x * 2.0
        return two_stage(y, 3.0) * 2.0

    x = jnp.array([0.25, 0.5])
    got = mm.jit(outer, mesh=mesh4x2)(x)
    with mesh4x2:
        want = jax.jit(reference)(x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert mm.jit(outer, mesh=mesh4x2).lower(x).plan.fragments  # tasks a, b, c placed
    stages = {fr.stage for fr in mm.jit(outer, mesh=mesh4x2).lower(x).plan.fragments}
    assert {0, 1, 2} <= stages
    other = mm.make_mesh((4, 2), ("stage", "model"))
    with pytest.raises(ValueError, match="'two_stage'.*another MultiMesh"):
        mm.jit(outer, mesh=other)(x)
    with pytest.raises(Exception, match="inside jax.jit"):
        jax.jit(lambda x: inner(x, 3.0))(x)  # MPMD inside one SPMD program: refused


def test_tracing_errors_name_the_users_function_and_argument(mesh4x2):
    def bad_concrete(params, x):
        with mm.task("a", stage=0):
            if x.sum() > 0:
                return x * params["w"]
        return -x

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        mm.jit(bad_concrete, mesh=mesh4x2)({"w": jnp.ones(2)}, jnp.ones(2))
    text = str(info.value)
    assert "bad_concrete at " in text and "test_jax_config.py" in text
    assert "argument x" in text and "leaves[" not in text and "flat_fun" not in text


def test_user_errors_keep_no_multimesh_frames(mesh4x2):
    import traceback

    def f(x):
        with mm.task("a", stage=0):
            raise KeyError("mine")

    with pytest.raises(KeyError) as info:
        mm.jit(f, mesh=mesh4x2)(jnp.ones(2))
    files = [fr.filename for fr in traceback.extract_tb(info.value.__traceback__)]
    if info.value.__cause__ is not None:  # JAX's filtered traceback, when filtering is on
        files = [fr.filename for fr in traceback.extract_tb(info.value.__cause__.__traceback__)]
    assert not any("/multimesh/" in f for f in files), files


def test_unhashable_static_argument_is_a_value_error(mesh4x2):
    g = mm.jit(two_stage, mesh=mesh4x2, static_argnums=1)
    with pytest.raises(ValueError, match="must be hashable"):
        g(jnp.ones(2), [2.0])


def test_disable_jit_reaches_grad_vmap_and_compiled(mesh4x2):
    g = mm.jit(lambda x: two_stage(x, 2.0), mesh=mesh4x2)
    x = jnp.array([0.25, 0.5])
    compiled = g.lower(x).compile()
    want = jax.grad(lambda v: two_stage(v, 2.0).sum())(x)
    with jax.disable_jit():
        np.testing.assert_allclose(jax.grad(lambda v: g(v).sum())(x), want, rtol=1e-6)
        np.testing.assert_allclose(jax.vmap(g)(x[:, None])[:, 0], two_stage(x, 2.0), rtol=1e-6)
        np.testing.assert_allclose(compiled(x), two_stage(x, 2.0), rtol=1e-6)
        with pytest.raises(RuntimeError, match="record.*disable_jit"):
            g.record(x)


def test_inner_mm_jit_options_that_would_be_dropped_are_errors(mesh4x2):
    x = jnp.array([0.25, 0.5])
    for kw in ({"out_shardings": P()}, {"task_rules": {"lay": 0}}):
        inner = mm.jit(lambda v: v * 2, mesh=mesh4x2, **kw)
        with pytest.raises(ValueError, match="would not apply there"):
            mm.jit(lambda v, inner=inner: inner(v) + 1, mesh=mesh4x2)(x)
    inner = mm.jit(lambda v: two_stage(v, 2.0), mesh=mesh4x2)

    def outer(v):
        with mm.task("t", mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))):
            v = v + 1
        return inner(v)

    with pytest.raises(ValueError, match="traced without one; give the outer mm.jit the same"):
        mm.jit(outer)(x)


def test_shard_map_given_the_submesh_inside_a_task_is_a_clear_error(mesh222):
    def f(x):
        with mm.task("a", stage=1):
            return jax.shard_map(
                lambda a: a * 2, mesh=mesh222.submesh(1), in_specs=P("data"), out_specs=P("data")
            )(x)

    with pytest.raises(ValueError, match="Leave out shard_map's mesh="):
        mm.jit(f, mesh=mesh222)(jnp.ones((4, 2)))


def test_tracing_errors_inside_microbatch_name_the_users_loss(mesh4x2):
    def loss(w, batch):
        with mm.task("a", stage=0):
            if batch.sum() > 0:
                return w.sum()
            return -w.sum()

    step = mm.microbatch(jax.grad(loss), 2, argnums=1)
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        mm.jit(step, mesh=mesh4x2)(jnp.ones(2), jnp.ones((4, 2)))
    text = str(info.value)
    assert "the function loss at " in text and "argument batch" in text, text


def test_varargs_are_named_as_jax_names_them(mesh4x2):
    def h(*xs):
        with mm.task("a", stage=0):
            if xs[1].sum() > 0:
                return xs[0]
            return -xs[0]

    with pytest.raises(jax.errors.TracerBoolConversionError, match=r"argument xs\[1\]"):
        mm.jit(h, mesh=mesh4x2)(jnp.ones(2), jnp.ones(2))


def test_under_disable_jit_compiled_still_checks_its_arguments(mesh4x2):
    c = mm.jit(lambda a, b: two_stage(a, 2.0) + b, mesh=mesh4x2).lower(jnp.ones(2), 1.0).compile()
    with jax.disable_jit():
        with pytest.raises(TypeError, match="different structure"):
            c(jnp.ones(2))
        with pytest.raises(TypeError, match="compiled with float32\\[2\\] and called with"):
            c(jnp.ones(3), 1.0)


def test_the_users_own_error_messages_are_left_alone(mesh4x2):
    def f(a):
        raise ValueError("leaves[0] and flat_fun are my words")

    with pytest.raises(ValueError, match=r"^leaves\[0\] and flat_fun are my words"):
        mm.jit(f, mesh=mesh4x2)(jnp.ones(2))
