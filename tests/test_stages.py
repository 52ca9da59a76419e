"""mm.jit behaves like jax.jit: staged API, argument checks, caches, out_shardings,
fresh outputs, donation."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close, reference, stage_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh as mm


def two_stage(w, x):
    with mm.task("a", stage=0):
        h = jnp.tanh(x @ w)
    with mm.task("b", stage=1):
        return (h * 2).sum(axis=1)


W = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)
X = jnp.linspace(0.0, 2.0, 32).reshape(8, 4)


class CompileCounter(logging.Handler):
    """Counts XLA compilations of MultiMesh fragments (jax_log_compiles)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        msg = record.getMessage()
        if "Finished XLA compilation of" in msg and "mm_" in msg:
            self.count += 1


@pytest.fixture
def compiles():
    h = CompileCounter()
    logger = logging.getLogger("jax")
    logger.addHandler(h)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    with jax.log_compiles(True):
        yield h
    logger.removeHandler(h)
    logger.setLevel(old)


def test_compile_options_and_analyses(mesh4x2):
    lowered = mm.jit(two_stage, mesh=mesh4x2).lower(W, X)
    compiled = lowered.compile(compiler_options={"xla_cpu_enable_fast_math": False})
    assert_close(compiled(W, X), reference(two_stage, mesh4x2, W, X))
    mem = compiled.memory_analysis()
    assert set(mem.per_submesh) == {0, 1}
    assert set(mem.per_fragment) == {f.name for f in compiled.plan.fragments}
    assert mem.argument_size_in_bytes > 0 and mem.submesh in (0, 1)
    assert mem.argument_size_in_bytes == mem.per_submesh[mem.submesh]["argument_size_in_bytes"]
    cost = compiled.cost_analysis()
    assert cost["flops"] > 0
    assert cost["flops"] == pytest.approx(
        sum(d.get("flops", 0) for d in cost.per_fragment.values())
    )
    assert set(cost.per_submesh) == {0, 1}
    assert "fragment" in lowered.as_text()
    assert lowered.out_info.shape == (8,)


def test_compiled_checks_arguments(mesh4x2):
    c = mm.jit(two_stage, mesh=mesh4x2).lower(W, X).compile()
    with pytest.raises(TypeError, match="different structure"):
        c((W, X))
    with pytest.raises(TypeError, match="different structure"):
        c(W, X, X)
    with pytest.raises(
        TypeError, match=r"argument x compiled with float32\[8,4\] and called with int32\[8,4\]"
    ):
        c(W, X.astype(jnp.int32))
    with pytest.raises(
        TypeError, match=r"argument w compiled with float32\[4,4\] and called with float32\[4,5\]"
    ):
        c(jnp.ones((4, 5)), X)
    elsewhere = jax.device_put(W, NamedSharding(mesh4x2.submesh(3), P()))
    with pytest.raises(
        ValueError, match=r"argument w is placed as NamedSharding\(devices \[6, 7\] \(data=2\)"
    ):
        c(elsewhere, X)


def test_compiled_takes_arguments_placed_as_when_lowered():
    """Like jax.stages.Compiled: arguments placed as they were when lowered are accepted,
    also where the program puts them (a device outside the mesh); another placement is a
    clear error naming the devices (a one-device submesh's mesh has no axes)."""
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    x7 = jax.device_put(X, jax.devices()[7])
    c = mm.jit(two_stage, mesh=mesh).lower(W, x7).compile()
    assert_close(c(W, x7), reference(two_stage, mesh, W, X))
    x6 = jax.device_put(X, jax.devices()[6])
    with pytest.raises(
        ValueError, match=r"argument x is placed as device 6, .* at NamedSharding\(devices \[0\], spec"
    ):
        c(W, x6)


def test_compiled_takes_dynamic_arguments_only(mesh4x2):
    f = mm.jit(lambda x, n: two_stage(W, x) * n, mesh=mesh4x2, static_argnums=-1)
    c = f.lower(X, 3).compile()
    assert_close(c(X), f(X, 3))
    assert_close(f(X, 3), reference(lambda x: two_stage(W, x) * 3, mesh4x2, X))


def test_lower_compile_seeds_call_cache_and_feedback_does_not_recompile(mesh4x2, compiles):
    opt = optax.adam(1e-2)

    def loss(w, x):
        return two_stage(w, x).mean()

    def step(state, x):
        w, o = state
        g = jax.grad(loss)(w, x)
        u, o = opt.update(g, o, w)
        return (optax.apply_updates(w, u), o), loss(w, x)

    f = mm.jit(step, mesh=mesh4x2)
    state = (W, opt.init(W))
    compiled = f.lower(state, X).compile()
    n = compiles.count
    assert n > 0
    state1, _ = f(state, X)
    state2, _ = f(state1, X)  # outputs fed back: placed where the program uses them
    state3, l3 = f(state2, X)
    assert compiles.count == n, "calls after lower().compile() must not compile"
    assert f._cache_size() == 1
    with mesh4x2:
        r = jax.jit(step)
        rs = state
        for _ in range(3):
            rs, rl = r(rs, X)
    assert_close(state3, rs, rtol=1e-5)
    assert_close(l3, rl)
    assert compiled is not None


def test_shape_dtype_struct_lowering(mesh4x2):
    f = mm.jit(two_stage, mesh=mesh4x2)
    w_sh = NamedSharding(mesh4x2.submesh(0), P())
    lowered = f.lower(
        jax.ShapeDtypeStruct(W.shape, W.dtype, sharding=w_sh),
        jax.ShapeDtypeStruct(X.shape, X.dtype),
    )
    c = lowered.compile()
    assert_close(c(jax.device_put(W, w_sh), X), reference(two_stage, mesh4x2, W, X))


def test_shape_dtype_struct_with_a_bare_spec_under_set_mesh(mesh4x2):
    """A bare PartitionSpec in a ShapeDtypeStruct is resolved on the caller's mesh
    (jax.set_mesh), as jax.jit does, though planning runs outside that context."""
    f = mm.jit(two_stage, mesh=mesh4x2)
    with jax.set_mesh(mesh4x2.mesh):
        x = jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=P("data"))
        c = f.lower(jax.ShapeDtypeStruct(W.shape, W.dtype), x).compile()
        traced = f.trace(jax.ShapeDtypeStruct(W.shape, W.dtype), x)
    assert traced.lower().plan.fragments
    assert c.input_shardings[0][1].spec == P("data")
    assert_close(c(W, X), reference(two_stage, mesh4x2, W, X))


@pytest.mark.parametrize(
    "spec_kind", ["pspec", "submesh", "other_submesh", "global", "none", "tree"]
)
def test_out_shardings(mesh222, spec_kind):
    mm_ = mesh222

    def f(w, x):
        with mm.task("a", stage=0):
            h = jnp.tanh(x @ w)
        with mm.task("b", stage=1):
            y = h * 2
        return y, h.sum()

    want = reference(f, mm_, W, X)
    sub1 = mm_.submesh(1)
    spec = {
        "pspec": (P("data"), None),
        "submesh": (NamedSharding(sub1, P("data", "model")), NamedSharding(sub1, P())),
        "other_submesh": (NamedSharding(mm_.submesh(0), P("data")), None),
        "global": (NamedSharding(mm_.mesh, P("data")), NamedSharding(mm_.mesh, P())),
        "none": None,
        "tree": (NamedSharding(sub1, P(None, "model")), NamedSharding(mm_.submesh(0), P())),
    }[spec_kind]
    got = mm.jit(f, mesh=mm_, out_shardings=spec)(W, X)
    assert_close(got, want)
    y, s = got
    if spec_kind == "pspec":
        assert stage_of(y, mm_) == 1 and y.sharding.spec == P("data")
    elif spec_kind == "submesh":
        assert y.sharding == spec[0] and s.sharding == spec[1]
    elif spec_kind == "other_submesh":
        assert stage_of(y, mm_) == 0 and y.sharding.spec == P("data")
    elif spec_kind == "global":
        assert y.sharding == spec[0] and len(y.sharding.device_set) == 8
        assert s.sharding == spec[1]
    elif spec_kind == "tree":
        assert y.sharding == spec[0] and s.sharding == spec[1]
    else:
        assert stage_of(y, mm_) == 1


def test_out_shardings_errors(mesh4x2):
    with pytest.raises(ValueError, match="names the stage axis"):
        mm.jit(two_stage, mesh=mesh4x2, out_shardings=P("stage"))
    with pytest.raises(ValueError, match="not a pytree prefix"):
        mm.jit(two_stage, mesh=mesh4x2, out_shardings=(P(), P()))(W, X)
    with pytest.raises(TypeError, match="expected a jax.sharding.Sharding"):
        mm.jit(two_stage, mesh=mesh4x2, out_shardings="data")


def test_in_shardings_validated(mesh4x2):
    with pytest.raises(ValueError, match="has 1 entries but the call has 2"):
        mm.jit(two_stage, mesh=mesh4x2, in_shardings=(P(),))(W, X)
    with pytest.raises(ValueError, match=r"in_shardings.*names the stage axis 'stage'"):
        mm.jit(two_stage, mesh=mesh4x2, in_shardings=P("stage"))
    with pytest.raises(ValueError, match="not a pytree prefix"):
        mm.jit(lambda t: two_stage(*t), mesh=mesh4x2, in_shardings=((P(), P(), P()),))((W, X))
    with pytest.raises(ValueError, match=r"names \['model'\]"):
        mm.jit(two_stage, mesh=mesh4x2, in_shardings=(P("model"), None))(W, X)
    f = mm.jit(two_stage, mesh=mesh4x2, in_shardings=(None, P("data")))
    assert_close(f(W, X), reference(two_stage, mesh4x2, W, X))


def test_shardings_on_reordered_or_foreign_devices(mesh4x2):
    """A NamedSharding on a submesh's devices in another order works as under jax.jit
    (in: laid out on the submesh; out: moved there after the program); one on devices
    that are neither the global mesh nor the submesh using the argument is a clear error
    (it was silently replaced by the submesh)."""
    d = jax.devices()
    want = reference(two_stage, mesh4x2, W, X)
    rev0 = NamedSharding(jax.sharding.Mesh(np.array([d[1], d[0]]), ("data",)), P("data"))
    rev1 = NamedSharding(jax.sharding.Mesh(np.array([d[3], d[2]]), ("data",)), P("data"))
    f = mm.jit(two_stage, mesh=mesh4x2, in_shardings=(rev0, None), out_shardings=rev1)
    got = f(W, X)
    assert_close(got, want)
    assert got.sharding == rev1
    assert_close(f(jax.device_put(W, rev0), X), want)
    other = NamedSharding(jax.sharding.Mesh(np.array([d[0], d[7]]), ("data",)), P("data"))
    with pytest.raises(ValueError, match=r"argument w: .* is not on the submesh that uses it"):
        mm.jit(two_stage, mesh=mesh4x2, in_shardings=(other, None))(W, X)
    # exactly another submesh: the value is put there (as jax.jit would), then moved
    on3 = NamedSharding(mesh4x2.submesh(3), P("data"))
    assert_close(mm.jit(two_stage, mesh=mesh4x2, in_shardings=(on3, None))(W, X), want)
    with pytest.raises(ValueError, match=r"argument w: .* has 3 entries, but that argument has"):
        mm.jit(two_stage, mesh=mesh4x2, in_shardings=(P(None, None, "data"), None))(W, X)
    with pytest.raises(ValueError, match=r"positional arguments only .*\['x'\]"):
        mm.jit(two_stage, mesh=mesh4x2, in_shardings=(None, None))(W, x=X)


def test_struct_call_and_eval_shape_errors(mesh4x2):
    """Calling with a ShapeDtypeStruct names the argument at once (it failed inside the
    executor after compiling); jax.eval_shape of an mm.jit function points to
    ``.eval_shape``."""
    f = mm.jit(two_stage, mesh=mesh4x2)
    sds = jax.ShapeDtypeStruct(W.shape, W.dtype)
    with pytest.raises(TypeError, match=r"argument w: .*ShapeDtypeStruct, not a value"):
        f(sds, X)
    compiled = f.lower(sds, X).compile()
    with pytest.raises(TypeError, match=r"argument w: .*ShapeDtypeStruct, not a value"):
        compiled(sds, X)
    assert_close(compiled(W, X), reference(two_stage, mesh4x2, W, X))
    assert f.eval_shape(W, X).shape == (8,)


def test_jax_eval_shape_of_an_mm_jit_function(mesh4x2):
    """``jax.eval_shape(f, ...)``, ``jax.make_jaxpr(f)`` and ``jax.jit(f).trace(...)``
    give the outputs' types as for a ``jax.jit`` function (they raised "must be the
    outermost transformation"); running, differentiating or batching it still raises."""

    def g(w, x, n=2):
        y = two_stage(w, x)
        return {"y": y * n, "s": (y.sum(), 3.0), "i": jnp.arange(n)}

    f = mm.jit(g, mesh=mesh4x2, static_argnames="n")
    want = jax.eval_shape(jax.jit(g, static_argnames="n"), W, X)
    assert jax.eval_shape(f, W, X) == want == f.eval_shape(W, X)
    bf = jax.ShapeDtypeStruct(W.shape, jnp.bfloat16)
    assert jax.eval_shape(f, bf, X) == jax.eval_shape(jax.jit(g), bf, X)
    assert jax.eval_shape(functools.partial(f, n=3), W, X)["i"].shape == (3,)
    assert jax.jit(f).trace(W, X).out_info == want
    assert "mm_jit_call" in str(jax.make_jaxpr(f)(W, X))
    with pytest.raises(TypeError, match=r"static argument 'n' is a traced value.*f.eval_shape"):
        jax.eval_shape(f, W, X, n=3)  # jax.eval_shape traces keyword arguments too
    for run in (
        lambda: jax.jit(f)(W, X),
        # an unused call is not dropped as dead code (it ran without its effects)
        lambda: jax.jit(lambda w, x: (f(w, x), x + 1)[1])(W, X),
        lambda: jax.grad(lambda w: f(w, X)["s"][0])(W),
        lambda: jax.jvp(lambda w: f(w, X)["y"], (W,), (W,)),
        lambda: jax.vmap(lambda x: f(W, x)["y"])(X[None]),
    ):
        with pytest.raises(TypeError, match="mm.jit must be the outermost transformation"):
            run()
    assert_close(f(W, X)["y"], 2 * reference(two_stage, mesh4x2, W, X))


def test_negative_static_argnums(mesh4x2):
    def f(x, scale, n):
        with mm.task("a", stage=0):
            return x * scale * n

    g = mm.jit(f, mesh=mesh4x2, static_argnums=(-1,))
    assert_close(g(X, 2.0, 3), X * 6)
    assert_close(g(X, 2.0, 4), X * 8)
    assert g._cache_size() == 2

    # counted as jax.jit counts: from the end of the call's positional arguments on jax
    # 0.10 (with a defaulted last parameter, h(x, s, 3) makes the 3 static: it made `m`
    # static), from the end of the signature on jax 0.12
    def h(x, scale, n, m=1):
        with mm.task("a", stage=0):
            return x * scale * sum(range(n)) * m

    def outcome(fn, *args, **kwargs):
        try:
            return np.asarray(fn(*args, **kwargs))
        except (ValueError, TypeError, jax.errors.JAXTypeError) as e:
            return type(e)

    g = mm.jit(h, mesh=mesh4x2, static_argnums=-1)
    j = jax.jit(h, static_argnums=-1)
    calls = [((X, 2.0, 3), {}), ((X, 2.0, 3, 2), {}), ((X, 2.0, 3), {"m": 2})]
    calls += [((), {"x": X, "scale": 2.0, "n": 3})]  # all by keyword
    for args, kwargs in calls:
        want, got = outcome(j, *args, **kwargs), outcome(g, *args, **kwargs)
        if isinstance(want, type):
            assert got is want, (args, kwargs, got, want)
        else:
            assert_close(got, want)
    from multimesh import _compat

    assert isinstance(outcome(g, X, 2.0, 3), type) != _compat.negative_static_argnums_from_call()


def test_constant_and_literal_outputs_are_fresh(mesh4x2):
    c = jnp.arange(3.0)

    def f(x):
        with mm.task("a", stage=1):
            y = x + 1
        return y, 1.0, c, 2

    g = mm.jit(f, mesh=mesh4x2)
    a = g(X)
    b = g(X)
    want = reference(f, mesh4x2, X)
    assert_close(a, want)
    for k in (1, 2, 3):
        assert a[k] is not b[k]
        assert a[k].weak_type == want[k].weak_type
    assert a[1].weak_type and a[3].weak_type and not a[2].weak_type
    a[1].delete()
    a[2].delete()
    assert float(g(X)[1]) == 1.0  # deleting one call's outputs does not break later calls
    # donating a state that holds a literal/constant output works, call after call
    h = mm.jit(lambda s: (s[0] + 1, s[1], s[2]), mesh=mesh4x2, donate_argnums=0)
    c2 = jnp.arange(3.0)
    s = (jnp.ones(2), jnp.float32(0.5), c2)
    for _ in range(3):
        s = h(s)
    assert_close(s[0], jnp.full(2, 4.0))
    np.testing.assert_array_equal(np.asarray(s[2]), np.arange(3.0))
    assert c2.is_deleted()  # donated, as under jax.jit
    np.testing.assert_array_equal(np.asarray(c), np.arange(3.0))  # g's constant: kept
    assert_close(g(X), want)


def test_passthrough_output_is_a_distinct_array(mesh4x2):
    x = jax.device_put(X, NamedSharding(mesh4x2.submesh(0), P()))
    g = mm.jit(lambda a, b: (a, two_stage(W, b)), mesh=mesh4x2)
    out, _ = g(x, X)
    assert out is not x
    donate = mm.jit(lambda a: a * 2, mesh=mesh4x2, donate_argnums=0)
    donate(out)
    assert out.is_deleted() and not x.is_deleted()
    np.testing.assert_array_equal(np.asarray(x), np.asarray(X))


def test_reusing_a_donated_input_is_a_clear_error(mesh4x2):
    def step(w, x):
        with mm.task("a", stage=0):
            return w - 0.1 * x

    f = mm.jit(step, mesh=mesh4x2, donate_argnums=0)
    w = jax.device_put(jnp.ones((4, 4)), NamedSharding(mesh4x2.submesh(0), P()))
    f(w, jnp.ones((4, 4)))
    assert w.is_deleted()
    with pytest.raises(RuntimeError, match="argument w has been deleted"):
        f(w, jnp.ones((4, 4)))
    c = f.lower(jnp.ones((4, 4)), jnp.ones((4, 4))).compile()
    with pytest.raises(RuntimeError, match="argument w has been deleted"):
        c(w, jnp.ones((4, 4)))


def test_mm_jit_inside_transformations_is_a_clear_error(mesh4x2):
    f = mm.jit(lambda w, x: two_stage(w, x).sum(), mesh=mesh4x2)
    from jax.experimental import checkify

    # checkify's default rule took the call's own parameter "error" (an internal
    # TypeError: "got multiple values for argument 'error'")
    for wrap in (
        jax.grad,
        jax.jit,
        lambda g: jax.vmap(g, in_axes=(None, 0)),
        lambda g: lambda w, x: checkify.checkify(g)(w, x[0]),
    ):
        with pytest.raises(TypeError, match="mm.jit must be the outermost transformation"):
            wrap(f)(W, X[None])
    # concrete (closed-over) arguments inside a trace: the same error, before and after
    # the function was compiled (JAX's own errors from inside before)
    for _ in range(2):
        with pytest.raises(TypeError, match="mm.jit must be the outermost transformation"):
            jax.jit(lambda c: c + f(W, X))(1.0)
        c = f.lower(W, X).compile()
        with pytest.raises(TypeError, match="mm.jit must be the outermost transformation"):
            jax.jit(lambda s, c=c: s + c(W, X))(1.0)
        f(W, X)


def test_non_array_output_is_named(mesh4x2):
    def f(x):
        with mm.task("a", stage=0):
            return {"y": x * 2, "tag": "hello"}

    with pytest.raises(TypeError, match=r"output\['tag'\] of 'f' is a str, not an array"):
        mm.jit(f, mesh=mesh4x2)(X)


def test_eval_shape(mesh4x2):
    out = mm.jit(two_stage, mesh=mesh4x2).eval_shape(W, X)
    assert out.shape == (8,) and out.dtype == jnp.float32

    def constrained(w, x):  # a bare spec: the function's mesh= gives it meaning
        with mm.task("a", stage=0):
            h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w), P("data"))
        with mm.task("b", stage=1):
            return (h * 2).sum(axis=1)

    f = mm.jit(jax.value_and_grad(lambda w, x: constrained(w, x).sum()), mesh=mesh4x2)
    v, g = f.eval_shape(W, X)  # was "with_sharding_constraint requires a non-empty mesh"
    assert (v.shape, g.shape) == ((), W.shape)
    assert_close(f(W, X)[1], reference(jax.grad(lambda w, x: constrained(w, x).sum()), mesh4x2, W, X))


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_args_info_in_avals_and_donation_like_jax_stages(mesh4x2):
    """``args_info``, ``in_avals`` and ``donate_argnums`` as jax.stages gives them (static
    arguments left out); ``Lowered.cost_analysis`` and a clear ``compiler_ir`` error."""

    def f(w, x, n):
        return two_stage(w, x) * n

    jf = jax.jit(f, static_argnums=2, donate_argnums=1).lower(W, X, 3)
    mf = mm.jit(f, mesh=mesh4x2, static_argnums=2, donate_argnums=1).lower(W, X, 3)
    for lowered_or_compiled in (mf, mf.compile()):
        info = lowered_or_compiled.args_info
        want = jf.args_info
        assert jax.tree.structure(info) == jax.tree.structure(want)
        got_l, want_l = jax.tree.leaves(info), jax.tree.leaves(want)
        assert [(a.shape, a.dtype, a.donated) for a in got_l] == [
            (a.shape, a.dtype, a.donated) for a in want_l
        ]
        assert lowered_or_compiled.donate_argnums == jf.donate_argnums == (1,)
        assert jax.tree.map(lambda a: (a.shape, a.dtype), lowered_or_compiled.in_avals) == (
            jax.tree.map(lambda a: (a.shape, a.dtype), jf.in_avals)
        )
    assert mf.cost_analysis()["flops"] > 0
    with pytest.raises(NotImplementedError, match="one per fragment"):
        mf.compiler_ir()


def test_trace_stage_like_jax_stages(mesh4x2):
    """``mm.jit(f).trace(*args)`` as ``jax.jit(f).trace``: jaxpr, out_info, args_info,
    then ``.lower().compile()`` runs it."""

    def f(x, n):
        with mm.task("a", stage=0):
            y = x * n
        with mm.task("b", stage=1):
            return y.sum(), y

    g = mm.jit(f, mesh=mesh4x2, static_argnums=1, donate_argnums=0)
    t = g.trace(X, 3)
    want = jax.jit(f, static_argnums=1, donate_argnums=0).trace(X, 3)
    assert isinstance(t, mm.TracedCall)
    assert str(t.jaxpr) == str(want.jaxpr)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), t.out_info) == jax.tree.map(
        lambda a: (a.shape, a.dtype), want.out_info
    )
    assert [a.donated for a in jax.tree.leaves(t.args_info)] == [True]
    c = t.lower().compile()
    x = X + 0
    assert_close(c(x), reference(lambda x: f(x, 3), mesh4x2, X))
    assert x.is_deleted()


def test_trace_lower_lowering_platforms(mesh4x2):
    """``TracedCall.lower(lowering_platforms=...)`` as ``jax.stages.Traced.lower``: the
    devices' own platform lowers; another is a clear error (it was a TypeError)."""

    def f(x):
        with mm.task("a", stage=0):
            return x * 2

    t = mm.jit(f, mesh=mesh4x2).trace(X)
    platform = jax.devices()[0].platform
    assert_close(t.lower(lowering_platforms=(platform,)).compile()(X), X * 2)
    with pytest.raises(ValueError, match=r"'f'.*lowering_platforms=\['tpu'\].*not supported"):
        t.lower(lowering_platforms=("tpu",))


def test_lowered_and_traced_compile_after_their_arguments_are_donated(mesh4x2):
    """A Lowered / TracedCall keeps what it needs of its arguments: compiling it after a
    donating call deleted them works, as with jax.stages (found by a probe)."""

    def f(w, x):
        with mm.task("a", stage=0):
            h = x @ w
        with mm.task("b", stage=1):
            return h * 2

    g = mm.jit(f, mesh=mesh4x2, donate_argnums=0)
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    lowered, traced = g.lower(w, x), g.trace(w, x)
    g(w, x)
    assert w.is_deleted()
    want = reference(f, mesh4x2, jnp.ones((4, 4)), x)
    for c in (lowered.compile(), traced.lower().compile()):
        assert_close(c(jnp.ones((4, 4)), x), want)


def test_out_shardings_single_device_sharding():
    """``out_shardings`` takes a ``SingleDeviceSharding`` (an array's own sharding on a
    one-device submesh), as jax.jit does."""
    mmesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])

    def f(x):
        with mm.task("a", stage=0):
            y = x * 2
        with mm.task("b", stage=1):
            return y + 1, y

    d0, d1 = jax.devices()[:2]
    shs = (jax.sharding.SingleDeviceSharding(d1), jax.sharding.SingleDeviceSharding(d0))
    out = mm.jit(f, mesh=mmesh, out_shardings=shs)(X)
    assert_close(out, reference(f, mmesh, X))
    assert [{d.id for d in o.sharding.device_set} for o in out] == [{1}, {0}]


def _weak_two_stage_mesh(shape=(2, 2), names=("stage", "model")):
    return mm.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def _types(outs):
    return [(str(o.dtype), o.weak_type, o.shape) for o in outs]


def test_outputs_keep_the_programs_weak_types():
    """Outputs assembled over several submeshes, replicated by out_shardings, or an
    argument passed through keep jax.jit's weak types (they came back strongly typed:
    ``bf16 * out`` then promoted to float32)."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _weak_two_stage_mesh()
    w, h = jnp.full((4,), 2.0), jnp.ones((4,), jnp.bfloat16)
    assert w.weak_type

    def f(w, h):
        with mm.task("a", stage=0):
            c = w * 3
        with mm.task("b", stage=1):
            z = h * w
        return w, c, z

    assert _types(mm.jit(f, mesh=mesh)(w, h)) == _types(jax.jit(f)(w, h))
    repl = NamedSharding(mesh.mesh, PartitionSpec())
    got = mm.jit(f, mesh=mesh, out_shardings=repl)(w, h)
    assert _types(got) == _types(jax.jit(f, out_shardings=repl)(w, h))
    assert (h * got[0]).dtype == jnp.bfloat16

    def g(step, x):
        lr = 0.1 * (step + 1)  # weakly typed, used on both stages
        with mm.task("a", stage=0):
            a = x * lr
        with mm.task("b", stage=1):
            b = a + lr
        return b, lr

    step, x = jnp.int32(3), jnp.ones((4,), jnp.bfloat16)
    assert _types(mm.jit(g, mesh=mesh)(step, x)) == _types(jax.jit(g)(step, x))


def test_compiled_returns_a_passed_through_argument_with_the_compiled_type():
    mesh = _weak_two_stage_mesh((2,), ("stage",))
    h = jnp.ones((4,), jnp.bfloat16)

    def f(x, h):
        with mm.task("a", stage=0):
            y = h * 2
        with mm.task("b", stage=1):
            return y * x, x

    for compiled_with, called_with in [
        (jnp.float32(2), jnp.asarray(2.0)),
        (jnp.asarray(2.0), jnp.float32(2)),
    ]:
        want = jax.jit(f).lower(compiled_with, h).compile()(called_with, h)
        got = mm.jit(f, mesh=mesh).lower(compiled_with, h).compile()(called_with, h)
        assert _types(got) == _types(want)


def test_replicated_out_shardings_on_a_one_axis_multimesh():
    """``NamedSharding(mmesh.mesh, P())`` on a mesh with only the stage axis (crashed)."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _weak_two_stage_mesh((2,), ("stage",))

    def f(x):
        with mm.task("a", stage=0):
            a = x * 2
        with mm.task("b", stage=1):
            b = a + 1
        return b, a, jax.random.key(3)

    x = jnp.ones((4, 4))
    repl = NamedSharding(mesh.mesh, PartitionSpec())
    got = mm.jit(f, mesh=mesh, out_shardings=repl)(x)
    want = jax.jit(f, out_shardings=repl)(x)
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(a, b)
        assert a.sharding.is_equivalent_to(repl, a.ndim)
    np.testing.assert_array_equal(jax.random.key_data(got[2]), jax.random.key_data(want[2]))


def test_literal_outputs_placed_on_different_submeshes():
    """Constant outputs whose out_shardings name different submeshes (one executable
    for all of them failed: JAX's incompatible devices)."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _weak_two_stage_mesh((2,), ("stage",))
    s0 = NamedSharding(mesh.submesh(0), PartitionSpec())
    s1 = NamedSharding(mesh.submesh(1), PartitionSpec())

    def f(x):
        with mm.task("a", stage=0):
            a = x * 2
        return a, 1.0, 2.0

    got = mm.jit(f, mesh=mesh, out_shardings=(None, s0, s1))(jnp.ones(4))
    assert [sorted(d.id for d in o.sharding.device_set) for o in got] == [[0], [0], [1]]
    assert [float(o) for o in got[1:]] == [1.0, 2.0]
    assert _types(got) == _types(jax.jit(f)(jnp.ones(4)))


def test_compiled_names_the_placement_it_was_lowered_with():
    """An argument the program puts (stage-sharded, used whole on two stages) placed
    otherwise than lowered: the error names the lowered placement (it named only where
    the program puts it, P())."""
    mmesh = mm.make_mesh((2, 2, 2), ("stage", "data", "model"))

    def f(x):
        with mm.task("a", stage=0):
            h = x * 2
        with mm.task("b", stage=1):
            return h + x

    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    xs = jax.device_put(x, NamedSharding(mmesh.mesh, P("stage")))
    c = mm.jit(f, mesh=mmesh).lower(xs).compile()
    assert_close(c(xs), x * 3)
    with pytest.raises(ValueError, match=r"spec P\('stage',\)\) \(lowered with it; put at"):
        c(jax.device_put(x, NamedSharding(mmesh.mesh, P("data"))))


def test_staged_objects_have_jax_stages_attributes(mesh4x2):
    """The rest of jax.stages' public surface: ``Lowered.as_text(dialect, debug_info=)``
    (an IR dialect is a clear NotImplementedError, as ``compiler_ir``),
    ``Traced.out_avals``, ``Compiled.input_formats``/``output_formats`` (Formats with the
    shardings ``input_shardings``/``output_shardings`` give) and ``runtime_executable``
    (one per fragment). Each was an AttributeError or a bare TypeError."""
    g = mm.jit(two_stage, mesh=mesh4x2)
    want = jax.jit(two_stage).trace(W, X)
    t = g.trace(W, X)
    assert jax.tree.structure(t.out_avals) == jax.tree.structure(want.out_avals)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(t.out_avals)] == [
        (a.shape, a.dtype) for a in jax.tree.leaves(want.out_avals)
    ]
    lowered = t.lower()
    assert lowered.as_text(debug_info=True) == lowered.as_text() == lowered.as_text(None)
    with pytest.raises(NotImplementedError, match="fragment"):
        lowered.as_text("hlo")
    c = lowered.compile()
    jc = want.lower().compile()
    ins, outs = c.input_formats, c.output_formats
    assert jax.tree.structure(ins, is_leaf=lambda x: x is None) == jax.tree.structure(
        jc.input_formats
    )
    assert jax.tree.structure(outs) == jax.tree.structure(jc.output_formats)
    assert [f.sharding for f in jax.tree.leaves(outs)] == jax.tree.leaves(c.output_shardings)
    homes = jax.tree.leaves(c.input_shardings, is_leaf=lambda x: x is None)
    for f, sh in zip(jax.tree.leaves(ins, is_leaf=lambda x: x is None), homes, strict=True):
        assert (f is None) == (sh is None) and (f is None or f.sharding == sh)
    exes = c.runtime_executable()
    assert len(exes) == len(c.fragments) == len(c.plan.fragments)
    assert all(e is not None for e in exes)


def test_repeated_lower_compile_keeps_no_old_programs(mesh4x2):
    """Each ``lower().compile()`` seeds the call cache for its signature; the program it
    replaces is released (all were kept: +1 live array (a kept constant) and more live
    executables per compile, a leak in a loop that re-lowers, e.g. for
    ``memory_analysis`` each epoch)."""
    import gc

    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"s{i}", stage=i):
                h = jnp.tanh(h @ w)
        return h.sum()

    def step(ws, x):
        v, g = mm.microbatch(jax.value_and_grad(loss), 4, argnums=1)(ws, x)
        return [w - 0.1 * d for w, d in zip(ws, g, strict=True)], v

    ws, x = [jnp.eye(8) * 0.5 for _ in range(4)], jnp.ones((16, 8))
    f = mm.jit(step, mesh=mesh4x2)
    ws, _ = f(ws, x)
    ws, _ = f(ws, x)  # committed to their submeshes now
    want = reference(step, mesh4x2, mm.distributed.to_host(ws), x)
    client = jax.devices()[0].client
    counts = []
    for _ in range(6):
        c = f.lower(ws, x).compile()
        assert_close(c(ws, x), want)
        del c
        gc.collect()
        counts.append((len(jax.live_arrays()), len(client.live_executables())))
    assert counts[-1] == counts[1], counts  # flat after the first
    assert f._cache_size() <= 2


def test_jit_as_a_decorator_factory_with_compiler_options(mesh4x2):
    """``@mm.jit(...)`` without the function returns a decorator (as jax.jit);
    ``compiler_options`` reach every fragment's XLA compile (an unknown one fails there,
    as under jax.jit); ``keep_unused`` is accepted."""

    @mm.jit(mesh=mesh4x2, static_argnums=2, keep_unused=True)
    def f(w, x, n):
        return two_stage(w, x) * n

    assert f.__name__ == "f"
    assert_close(f(W, X, 3), reference(two_stage, mesh4x2, W, X) * 3)
    ok = mm.jit(two_stage, mesh=mesh4x2, compiler_options={"xla_cpu_enable_fast_math": False})
    assert_close(ok(W, X), reference(two_stage, mesh4x2, W, X))
    bad = mm.jit(two_stage, mesh=mesh4x2, compiler_options={"not_an_xla_option": True})
    with pytest.raises(Exception, match="not_an_xla_option"):
        bad(W, X)


def test_argnums_and_argnames_take_what_jax_jit_takes(mesh4x2):
    """``None`` (jax.jit's own default), NumPy integers and ``True`` (an index) are
    taken as ``jax.jit`` takes them, as is ``keep_unused=1``; they were TypeErrors
    ("'NoneType' object is not iterable")."""

    def f(w, x, n):
        return two_stage(w, x) * n

    want = reference(two_stage, mesh4x2, W, X) * 3
    for kw in (
        {"static_argnums": None, "static_argnames": "n"},
        {"static_argnums": np.int64(2), "static_argnames": None},
        {"static_argnums": (np.int32(2),), "donate_argnums": None, "donate_argnames": None},
    ):
        jax.jit(f, **kw)  # jax.jit takes these too
        assert_close(mm.jit(f, mesh=mesh4x2, **kw)(W, X, n=3), want)

    def g(x, flag):
        return two_stage(W, x) * (2 if flag else 1)

    jax.jit(g, static_argnums=True)
    assert_close(
        mm.jit(g, mesh=mesh4x2, static_argnums=True)(X, True),
        reference(two_stage, mesh4x2, W, X) * 2,
    )
    assert_close(mm.jit(two_stage, mesh=mesh4x2, keep_unused=1)(W, X), want / 3)
    w = jnp.array(W, copy=True)  # not the shared W: donating deletes it
    mm.jit(two_stage, mesh=mesh4x2, donate_argnums=np.int64(0))(w, X)
    assert w.is_deleted()
    with pytest.raises(TypeError):  # as jax.jit
        mm.jit(f, mesh=mesh4x2, static_argnums=1.5)
    for bad in ([0], ("n", 1), b"n"):  # names must be str: a TypeError, as jax.jit's
        with pytest.raises(TypeError):
            jax.jit(f, static_argnames=bad)
        with pytest.raises(TypeError, match="takes parameter names"):
            mm.jit(f, mesh=mesh4x2, static_argnames=bad)
    # given both numbers and names, neither is inferred from the other (as jax.jit): only
    # a is donated, and n passed by position is traced, not static
    a, b = jnp.array(W, copy=True), jnp.array(W, copy=True)
    h = mm.jit(lambda a, b: two_stage(a, X) + two_stage(b, X), mesh=mesh4x2,
               donate_argnums=0, donate_argnames="b")
    h(a, b)
    assert a.is_deleted() and not b.is_deleted()
    k = mm.jit(f, mesh=mesh4x2, static_argnums=(), static_argnames="n")
    assert_close(k(W, X, jnp.float32(3)), want)
    with pytest.raises(ValueError, match="hashable|static"):
        mm.jit(f, mesh=mesh4x2, static_argnames="n")(W, X, jnp.ones(2))  # inferred


def test_trace_and_lower_take_deleted_arrays(mesh4x2):
    """As jax.jit(f).trace/.lower: a deleted (donated) argument's type is enough; a call
    with it is still an error."""
    d = jnp.ones((4, 4))
    d.delete()
    g = mm.jit(two_stage, mesh=mesh4x2)
    assert g.trace(d, X).out_info.shape == (8,)
    assert_close(g.lower(d, X).compile()(W, X), reference(two_stage, mesh4x2, W, X))
    with pytest.raises(RuntimeError, match="deleted"):
        g(d, X)


def test_memory_analysis_of_a_program_without_fragments(mesh4x2):
    mem = mm.jit(lambda a: a, mesh=mesh4x2).lower(X).compile().memory_analysis()
    assert mem.temp_size_in_bytes == 0 and mem.argument_size_in_bytes == 0
    assert mem.peak_memory_in_bytes == 0
    assert mem.per_submesh == {} and mem.submesh is None


def test_mm_jit_of_an_mm_jit_function_keeps_its_own_settings():
    """As jax.jit(jax.jit(f), ...): the outer object's options apply, not the inner's
    (its attributes are settings, not function attributes to copy)."""
    mmesh = mm.make_mesh((2, 1), ("stage", "d"), devices=jax.devices()[:2])

    def f(x):
        with jax.named_scope("layer0"):
            h = jnp.tanh(x) * 2
        with jax.named_scope("layer1"):
            return h + 1

    rules = {r"layer0": 0, r"layer1": 1}
    x = jnp.arange(3.0)
    outer = mm.jit(mm.jit(f), mesh=mmesh, task_rules=rules)
    assert [fr.name for fr in outer.lower(x).plan.fragments] == ["layer0", "layer1"]
    out = outer(x)
    assert stage_of(out, mmesh) == 1
    assert_close(out, reference(f, mmesh, x))
    # the inner object's rules do not become the outer's (they cannot apply inside
    # another program: a clear error)
    plain = mm.jit(mm.jit(f, mesh=mmesh, task_rules=rules), mesh=mmesh)
    with pytest.raises(ValueError, match="task_rules would not apply there"):
        plain(x)


def test_a_parameter_named_self_passes_by_keyword(mesh4x2):
    """As jax.jit: every entry point takes the function's own ``self`` by keyword."""

    def f(self, x):
        with mm.task("a", stage=0):
            h = self * x
        with mm.task("b", stage=1):
            return h + 1

    a = jnp.arange(3.0)
    fn = mm.jit(f, mesh=mesh4x2)
    want = reference(f, mesh4x2, self=a, x=a)
    assert_close(fn(self=a, x=a), want)
    assert_close(fn.lower(self=a, x=a).compile()(self=a, x=a), want)
    assert fn.trace(self=a, x=a).lower() is not None
    assert fn.eval_shape(self=a, x=a).shape == (3,)


def test_compiled_checks_python_scalars_against_the_current_x64_mode(mesh4x2):
    """A program compiled for a Python float as float32, called once x64 is on (the
    float is now float64): a TypeError naming the argument, as jax.stages.Compiled, not
    an XLA error from inside a fragment."""
    x = np.arange(3, dtype=np.float32)

    def f(x, s):
        with mm.task("a", stage=0):
            h = x * s
        with mm.task("b", stage=1):
            return h + 1

    c = mm.jit(f, mesh=mesh4x2).lower(x, 2.0).compile()
    assert_close(c(x, 3.0), reference(f, mesh4x2, x, 3.0))
    with jax.enable_x64(True):
        msg = r"argument s compiled with float32\[\] and called with float64\[\]"
        with pytest.raises(TypeError, match=msg):
            c(x, 2.0)
    assert_close(c(x, 2.0), reference(f, mesh4x2, x, 2.0))
