"""Argument handling: statics, donation, pytrees, scalars, dtypes, keys, odd shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, mlp_loss, reference, stage_of
from jax.sharding import NamedSharding

import multimesh as mm
from multimesh import _compat

P = jax.sharding.PartitionSpec


def two_stage(x, y):
    with mm.task("a", stage=0):
        u = x * 2
    with mm.task("b", stage=1):
        return u + y


def test_static_argnums_and_argnames(mesh4x2):
    def f(x, n, *, mode):
        with mm.task("a", stage=0):
            y = x * n
        with mm.task("b", stage=1):
            return y + 1 if mode == "add" else y - 1

    g = mm.jit(f, mesh=mesh4x2, static_argnums=1, static_argnames="mode")
    x = jnp.arange(4.0)
    np.testing.assert_allclose(g(x, 3, mode="add"), np.arange(4.0) * 3 + 1)
    np.testing.assert_allclose(g(x, 2, mode="sub"), np.arange(4.0) * 2 - 1)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(donate_argnames="xx"), "no parameter of that name"),
        (dict(static_argnames="nn"), "no parameter of that name"),
        (dict(donate_argnums=5), "takes only 2 positional"),
        (dict(static_argnums=7), "takes only 2 positional"),
        (dict(static_argnums=1, donate_argnums=1), "both static and donated"),
        (dict(static_argnums=1, donate_argnames="n"), "both static and donated"),
    ],
)
def test_argument_numbers_and_names_are_checked(mesh4x2, kw, words):
    """As jax.jit: a typo in static/donate arguments is an error, not staticness or
    donation silently off."""

    def f(x, n):
        with mm.task("a", stage=0):
            return x * n

    with pytest.raises(ValueError):  # what jax.jit does
        jax.jit(f, **kw)
    with pytest.raises(ValueError, match=words):
        mm.jit(f, mesh=mesh4x2, **kw)

    def g(x, /, *args, **kwargs):  # *args and **kwargs take any number or name
        return x

    mm.jit(g, mesh=mesh4x2, static_argnums=3, donate_argnames="anything")

    def h(x, /, y):
        return x

    with pytest.raises(ValueError, match="positional-only"):
        mm.jit(h, mesh=mesh4x2, static_argnames="x")


def test_static_values_equal_but_of_other_types_retrace(mesh4x2):
    """1, 1.0 and True are equal static values of different types: each its own trace,
    as under jax.jit (they shared the first one's program; found by a probe)."""

    def f(x, n):
        with mm.task("a", stage=0):
            return x * n, jnp.asarray(n), isinstance(n, float) * jnp.ones(())

    g = mm.jit(f, mesh=mesh4x2, static_argnums=1)
    x = jnp.ones(4)
    for n, dtype, is_float in [(1, jnp.int32, 0.0), (1.0, jnp.float32, 1.0), (True, jnp.bool_, 0.0)]:
        _y, a, flag = g(x, n)
        assert a.dtype == dtype and float(flag) == is_float, n
        assert g.eval_shape(x, n)[1].dtype == dtype


def test_python_scalars_returned_stay_weakly_typed(mesh4x2):
    def f(x, s, i):
        with mm.task("a", stage=0):
            h = x * s + i
        return h, s, i

    out = mm.jit(f, mesh=mesh4x2)(jnp.ones(4), 2.5, 3)
    want = reference(f, mesh4x2, jnp.ones(4), 2.5, 3)
    for o, w in zip(out[1:], want[1:]):
        assert (o.shape, o.dtype, o.aval.weak_type) == (w.shape, w.dtype, True), (o.aval, w.aval)
    assert (out[1] * jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16


def test_eval_shape_with_static_arguments_and_as_a_method(mesh4x2):
    from functools import partial

    def f(x, n, *, kind):
        with mm.task("a", stage=0):
            return jnp.zeros((n,)) + x.sum() if kind == "vec" else x * n

    g = mm.jit(f, mesh=mesh4x2, static_argnums=1, static_argnames="kind")
    assert g.eval_shape(jnp.ones((4, 8)), 3, kind="vec").shape == (3,)
    assert g.eval_shape(jnp.ones((4, 8)), 3, kind="mat").shape == (4, 8)

    class Model:
        def __init__(self, k):
            self.k = k

        def __hash__(self):
            return hash(self.k)

        def __eq__(self, other):
            return isinstance(other, Model) and other.k == self.k

        @partial(mm.jit, mesh=mesh4x2, static_argnums=0)
        def apply(self, x):
            with mm.task("a", stage=0):
                return x * self.k

    np.testing.assert_allclose(Model(3.0).apply(jnp.ones(4)), 3.0)
    np.testing.assert_allclose(Model(5.0).apply(jnp.ones(4)), 5.0)
    assert isinstance(Model.__dict__["apply"], type(g))


def test_pytrees_scalars_and_dtypes(mesh4x2):
    def f(tree, s, i):
        with mm.task("a", stage=0):
            a = tree["a"] * s + i
            b = tree["b"][0].astype(jnp.float32) @ jnp.ones((3,), jnp.float32)
        with mm.task("b", stage=1):
            c = (a.astype(jnp.bfloat16) * 2).astype(jnp.bfloat16)
            d = tree["b"][1] + i
        return {"c": c, "d": d, "b": b, "n": jnp.int32(7)}

    tree = {
        "a": jnp.arange(3.0),
        "b": (jnp.ones((2, 3), jnp.bfloat16), jnp.arange(3, dtype=jnp.int32)),
    }
    got = mm.jit(f, mesh=mesh4x2)(tree, 2.0, 3)
    assert_close(got, reference(f, mesh4x2, tree, 2.0, 3))
    assert got["c"].dtype == jnp.bfloat16 and got["d"].dtype == jnp.int32
    assert stage_of(got["d"], mesh4x2) == 1


def test_numpy_inputs_zero_size_and_0d(mesh4x2):
    def f(x, e, z):
        with mm.task("a", stage=0):
            a = x.sum() + z
            e2 = e * 2
        with mm.task("b", stage=1):
            return a * 3, e2 + 1, z

    args = (np.arange(6.0, dtype=np.float32), jnp.zeros((0, 3)), jnp.float32(2.0))
    got = mm.jit(f, mesh=mesh4x2)(*args)
    assert_close(got, reference(f, mesh4x2, *args))
    assert got[1].shape == (0, 3)


def test_prng_keys_in_and_out(mesh4x2):
    def f(key):
        with mm.task("a", stage=0):
            k1, k2 = jax.random.split(key)
            a = jax.random.normal(k1, (3,))
        with mm.task("b", stage=1):
            b = jax.random.uniform(k2, (3,)) + a
        return b, k2

    for key in (jax.random.key(0), jax.random.PRNGKey(1)):
        got = mm.jit(f, mesh=mesh4x2)(key)
        want = reference(f, mesh4x2, key)
        assert_close(got[0], want[0])
        assert np.array_equal(
            jax.random.key_data(got[1]) if got[1].dtype != jnp.uint32 else got[1],
            jax.random.key_data(want[1]) if want[1].dtype != jnp.uint32 else want[1],
        )


def test_passed_through_key_keeps_its_committed_sharding(mesh4x2):
    """A PRNG key returned unchanged is a fresh array on the same committed sharding (as
    jax.jit), not an uncommitted copy on the default device: fed back, it plans the same."""
    from jax.sharding import NamedSharding, PartitionSpec

    def f(x, key):
        with mm.task("a", stage=0):
            y = x + jax.random.uniform(key, x.shape)
        return y, key

    g = mm.jit(f, mesh=mesh4x2)
    stage1 = NamedSharding(mesh4x2.submesh(1), PartitionSpec())
    key = jax.device_put(jax.random.key(3), stage1)
    y, k2 = g(jnp.zeros(3), key)
    assert k2 is not key and k2.committed and k2.sharding == key.sharding
    np.testing.assert_array_equal(jax.random.key_data(k2), jax.random.key_data(key))
    _, k3 = g(jnp.zeros(3), k2)
    assert g._cache_size() == 1 and k3.sharding == key.sharding
    assert_close(y, reference(f, mesh4x2, jnp.zeros(3), jax.random.key(3))[0])


def test_key_output_replicated_over_every_stage(mesh4x2):
    """A PRNG key made on stage 0, returned replicated over the global mesh: copied to
    every stage (through its key data), equal to jax.jit's key."""
    from jax.sharding import NamedSharding, PartitionSpec

    def f(seed):
        with mm.task("a", stage=0):
            key = jax.random.fold_in(jax.random.key(0), seed)
        with mm.task("b", stage=1):
            y = seed * 2
        return key, y

    rep = NamedSharding(mesh4x2.mesh, PartitionSpec())
    got, _ = mm.jit(f, mesh=mesh4x2, out_shardings=(rep, None))(jnp.uint32(5))
    want, _ = reference(f, mesh4x2, jnp.uint32(5))
    assert got.sharding == rep and len(got.addressable_shards) == 8
    for sh in jax.random.key_data(got).addressable_shards:
        np.testing.assert_array_equal(np.asarray(sh.data), np.asarray(jax.random.key_data(want)))


def test_donate_argnums(mesh4x2):
    def step(w, x):
        with mm.task("a", stage=0):
            return w - 0.1 * x, (w * x).sum()

    f = mm.jit(step, mesh=mesh4x2, donate_argnums=0)
    w = jnp.ones((4, 4))
    w1, _ = f(w, jnp.ones((4, 4)))
    w2, s = f(w1, jnp.ones((4, 4)))  # w1 is committed on stage 0: donated into the step
    np.testing.assert_allclose(np.asarray(w2), 0.8)
    assert w1.is_deleted()
    np.testing.assert_allclose(float(s), 14.4, rtol=1e-6)


def test_donated_arrays_are_deleted_wherever_they_are_used():
    """As under jax.jit, a donated array is deleted after the call also where its buffer
    could not be reused: committed to another submesh's device, replicated over the
    global mesh, used on two submeshes, returned (found by a probe)."""
    mmesh = mm.make_mesh((2, 4), ("stage", "data"))
    x = jnp.arange(32, dtype=jnp.float32).reshape(4, 8)

    def one(a):
        with mm.task("a", stage=0):
            return a * 2

    def two(a):
        with mm.task("a", stage=0):
            h = a * 2
        with mm.task("b", stage=1):
            return h + a

    def passthrough(a):
        with mm.task("a", stage=0):
            return a * 2, a

    cases = [
        (one, lambda: jax.device_put(x + 0, jax.devices()[5])),
        (one, lambda: jax.device_put(x + 0, jax.sharding.NamedSharding(mmesh.mesh, P()))),
        (two, lambda: x + 0),
        (passthrough, lambda: x + 0),
    ]
    for f, make in cases:
        a = make()
        got = mm.jit(f, mesh=mmesh, donate_argnums=0)(a)
        assert a.is_deleted()
        assert_close(got, reference(f, mmesh, x + 0))
        a = make()
        got = mm.jit(f, mesh=mmesh, donate_argnums=0).lower(a).compile()(a)
        assert a.is_deleted()
        assert_close(got, reference(f, mmesh, x + 0))


@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("at", [2, 0])
def test_a_call_failing_at_run_time_deletes_every_donated_argument(loop, at):
    """A callback raising on stage 2 fails the call at run time: every donated
    argument is deleted, as under jax.jit (only those work had used already were: a
    half-deleted parameter list; in a microbatch loop, none), and the next call with
    fresh arguments is right (found by a probe). On stage 0, the first fragment's
    launch raises: nothing was deleted then (a later probe)."""
    mmesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    fail = [False]

    def cb(_h):
        if fail[0]:
            fail[0] = False
            raise ValueError("boom")

    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"l{i}", stage=i):
                h = jnp.tanh(h @ w)
                if i == at:
                    jax.debug.callback(cb, h)
        return jnp.mean(h**2)

    def f(ws, x):
        if loop:
            val, g = mm.microbatch(jax.value_and_grad(loss), 4, argnums=1)(ws, x)
        else:
            val, g = jax.value_and_grad(loss)(ws, x)
        return [w - 0.1 * gw for w, gw in zip(ws, g)], val

    ws0 = [np.eye(4, dtype=np.float32) * (i + 1) / 4 for i in range(4)]
    x = jnp.ones((8, 4))
    step = mm.jit(f, mesh=mmesh, donate_argnums=0)
    ws, _ = step([jnp.asarray(w) for w in ws0], x)
    fail[0] = True
    with pytest.raises(Exception, match="boom"):
        jax.block_until_ready(step(ws, x))
    assert [w.is_deleted() for w in ws] == [True] * 4
    got = step([jnp.asarray(w) for w in ws0], x)
    assert_close(got, jax.jit(f)([jnp.asarray(w) for w in ws0], x), rtol=1e-6)


def test_a_donated_array_passed_twice_is_an_error(mesh4x2):
    """``f(a, a)`` donating the first: a clear error naming both, as jax.jit's
    INVALID_ARGUMENT (was a segmentation fault; found by a probe)."""

    def f(a, b):
        with mm.task("a", stage=0):
            return a * 2 + b

    a = jnp.ones((4, 8))
    for donate in (0, (0, 1)):
        g = mm.jit(f, mesh=mesh4x2, donate_argnums=donate)
        with pytest.raises(ValueError, match="argument a is donated .* also passed as b"):
            g(a, a)
        with pytest.raises(ValueError, match="also passed as b"):
            g.lower(a, a).compile()(a, a)
        assert not a.is_deleted()
    np.testing.assert_allclose(g(a, jnp.ones((4, 8))), 3.0)  # distinct arrays: fine


def test_a_donated_array_aliased_by_another_argument_is_an_error(mesh4x2):
    """A different array object on the donated array's buffers (``jax.device_put`` to
    an equivalent sharding aliases them) is the same error, not a crash of JAX's
    runtime (``jax.jit`` segfaults here)."""
    from jax.sharding import Mesh, NamedSharding

    def f(a, b):
        with mm.task("a", stage=0):
            return a * 2 + b

    sub0 = mesh4x2.submesh(0)
    x = jax.device_put(jnp.ones((4,)), NamedSharding(sub0, P()))
    y = jax.device_put(x, NamedSharding(Mesh(sub0.devices, ("other",)), P()))
    if not set(_compat.buffer_pointers(x)) & set(_compat.buffer_pointers(y)):
        pytest.skip("this JAX copies instead of aliasing")
    assert y is not x
    for donate, match in ((0, "argument a is donated .* also passed as b"), (1, "argument b")):
        g = mm.jit(f, mesh=mesh4x2, donate_argnums=donate)
        with pytest.raises(ValueError, match=match):
            g(x, y)
        assert not x.is_deleted() and not y.is_deleted()
    z = jnp.ones((4,))  # same shape, other buffers: fine
    np.testing.assert_allclose(mm.jit(f, mesh=mesh4x2, donate_argnums=0)(x, z), 3.0)


def test_passthrough_and_literal_outputs(mesh4x2):
    def f(x, y):
        with mm.task("a", stage=1):
            z = x + 1
        return x, z, 1.5, y

    x = jnp.ones(3)
    y = jax.device_put(jnp.ones(2), mesh4x2.submesh(3).devices.flat[0])
    got = mm.jit(f, mesh=mesh4x2)(x, y)
    assert_close(got, reference(f, mesh4x2, x, np.asarray(y)))
    assert got[3] is y or np.array_equal(np.asarray(got[3]), np.asarray(y))


def test_arguments_returned_as_is_keep_their_own_layout(mesh4x2):
    """Committed arguments returned unchanged come back as fresh arrays in their own
    sharding, whichever stages' work reads them (they came back on the submeshes using
    them: replicated over stages 0 and 3 for a global array both read)."""

    def f(a, b, c, x):
        with mm.task("s0", stage=0):
            x = x @ a + b + c
        with mm.task("s3", stage=3):
            x = x @ a + b + c
        return x, a, b, c

    a = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh4x2.submesh(0), P(None, "data")))
    b = jax.device_put(jnp.arange(8.0), NamedSharding(mesh4x2.mesh, P()))
    c = jax.device_put(jnp.arange(8.0), NamedSharding(mesh4x2.mesh, P("data")))
    x = jnp.ones((4, 8))
    g = mm.jit(f, mesh=mesh4x2)
    out = g(a, b, c, x)
    assert_close(out[0], reference(f, mesh4x2, np.asarray(a), b, c, x)[0])
    for o, arg in zip(out[1:], (a, b, c)):
        assert o is not arg and o.sharding == arg.sharding
        np.testing.assert_array_equal(o, arg)
    out[2].delete()
    np.testing.assert_array_equal(b, np.arange(8.0))
    g(*out[1:2], b, out[3], x)  # fed back: the same plan
    assert g._cache_size() == 1


def test_kwargs_dynamic(mesh4x2):
    got = mm.jit(two_stage, mesh=mesh4x2)(x=jnp.ones(2), y=jnp.ones(2))
    np.testing.assert_allclose(np.asarray(got), 3.0)


def test_in_shardings(mesh4x2):
    f = mm.jit(two_stage, mesh=mesh4x2, in_shardings=(jax.P("data"), None))
    x = jnp.arange(8.0)
    plan = f.lower(x, x).plan
    got = f(x, x)
    np.testing.assert_allclose(np.asarray(got), np.arange(8.0) * 3)
    assert any(p.mode == "put" and p.arg == 0 and p.stage == 0 for p in plan.inputs)


def test_a_spec_in_shardings_moves_a_committed_array_to_that_layout(mesh4x2):
    """``in_shardings=P("data")`` with an array committed in another layout (replicated
    on the global mesh, on the submesh using it, or on another submesh): the program
    sees it in ``P("data")`` (as the README says; the entry was silently ignored for
    committed arrays). In that layout already, it is used in place. Indivisible entries
    are jax's ``IndivisibleError`` for arguments and outputs, as under jax.jit."""

    def f(x):
        with mm.task("a", stage=0):
            return x * 2

    x = jnp.arange(8.0)
    g = mm.jit(f, mesh=mesh4x2, in_shardings=P("data"))
    for where in (mesh4x2.mesh, mesh4x2.submesh(0), mesh4x2.submesh(1)):
        out = g(jax.device_put(x, NamedSharding(where, P())))
        assert_close(out, x * 2)
        # the fragment took it in P("data"): its elementwise output is laid out so
        assert out.sharding.spec == P("data"), (where, out.sharding)
        assert out.sharding.mesh.devices.tolist() == mesh4x2.submesh(0).devices.tolist()
    kept = jax.device_put(x, NamedSharding(mesh4x2.submesh(0), P("data")))
    assert [p.mode for p in g.lower(kept).plan.inputs] == ["as_is"]  # no copy
    assert [p.mode for p in g.lower(jax.device_put(x, NamedSharding(mesh4x2.submesh(0), P()))
                                     ).plan.inputs] == ["put"]
    bad = jax.device_put(jnp.ones(3), NamedSharding(mesh4x2.mesh, P()))
    with pytest.raises(ValueError, match=r"argument x \(the submesh of stage 0\).*partitioned") as e:
        g(bad)
    with pytest.raises(type(e.value)):  # the same type as jax.jit's
        jax.jit(f, in_shardings=NamedSharding(mesh4x2.submesh(0), P("data")))(jnp.ones(3))
    h = mm.jit(lambda v: v[:3] * 2, mesh=mesh4x2, out_shardings=P("data"))
    with pytest.raises(type(e.value), match=r"for output <root>: .*partitioned 2 times"):
        h(x)


def test_in_shardings_on_a_submesh_place_the_argument_there(mesh4x2):
    """A NamedSharding on one submesh puts a host argument there: untagged work on it
    runs next to it (it was refused, or ignored once an array committed elsewhere had
    been seen); a committed array with another sharding is an error, as with jax.jit."""
    on2 = NamedSharding(mesh4x2.submesh(2), jax.P("data"))
    f = mm.jit(lambda a: a * 2, mesh=mesh4x2, in_shardings=on2)
    x = jnp.arange(8.0)
    got = f(x)
    assert_close(got, x * 2)
    assert got.sharding.device_set == on2.device_set
    assert [(p.stage, p.mode) for p in f.lower(x).plan.inputs] == [(2, "put")]
    elsewhere = jax.device_put(x, NamedSharding(mesh4x2.submesh(0), jax.P()))
    with pytest.raises(ValueError, match=r"in_shardings for argument a: .*devices \[4, 5\]\) "
                       r"does not match .*devices \[0, 1\]"):
        f(elsewhere)
    with pytest.raises(ValueError, match="does not match"):
        f.lower(elsewhere)
    assert_close(f(jax.device_put(x, on2)), x * 2)
    assert_close(f(x), x * 2)  # unchanged by the calls before
    # the same layout on other devices is moved there, as jax.jit does
    moved = f(jax.device_put(x, NamedSharding(mesh4x2.submesh(0), jax.P("data"))))
    assert_close(moved, x * 2)
    assert moved.sharding.device_set == on2.device_set
    # the submesh's devices in another order name that submesh too
    rev = jax.sharding.Mesh(mesh4x2.submesh(2).devices[::-1], ("data",))
    out = mm.jit(lambda a: a * 2, mesh=mesh4x2, in_shardings=NamedSharding(rev, jax.P()))(x)
    assert out.sharding.device_set == on2.device_set
    with pytest.raises(ValueError, match=r"argument a: .* partitioned 2 times, but the dim"):
        f(jnp.ones(3))  # indivisible, as jax.jit says (also for an unused argument)
    unused = mm.jit(lambda a, b: b * 2, mesh=mesh4x2, in_shardings=(on2, None))
    with pytest.raises(ValueError, match=r"argument a: .* partitioned 2 times"):
        unused(jnp.ones(3), x)
    # a bare spec too (it named 'args[0]' and the library's compile call on jax 0.12)
    spec = mm.jit(lambda a: mm.task(lambda v: v * 2, name="t", stage=1)(a), mesh=mesh4x2,
                  in_shardings=jax.P("data"))
    with pytest.raises(ValueError, match=r"argument a \(the submesh of stage 1\): .* partitioned"):
        spec(jnp.ones((5, 3)))
    # used by a task on another stage: put there, then moved
    g = mm.jit(two_stage, mesh=mesh4x2, in_shardings=(on2, None))
    assert_close(g(x, x), reference(two_stage, mesh4x2, x, x))


def _mb_grad(num_microbatches, **kw):
    return mm.microbatch(
        jax.value_and_grad(mlp_loss), num_microbatches, argnums=(1, 2), schedule="1f1b", **kw
    )


def _mb_args(stacked=False):
    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(2)]
    x = rng.normal(size=(4, 3, 8) if stacked else (12, 8)).astype(np.float32)
    return ws, x, np.sin(x)


def _host_cut(plan):
    return [p for p in plan.inputs if p.mode == "host_slice"]


def test_host_batch_cut_on_the_host(mesh4x2):
    """Microbatches of a NumPy batch are cut on the host and put where they are used:
    no submesh slices the batch; values and gradients equal jax.jit's, whether the batch
    comes as NumPy, as an uncommitted device array or (for the compiled program) as a
    committed one elsewhere."""
    grad = _mb_grad(4)
    f = mm.jit(grad, mesh=mesh4x2)
    ws, x, y = _mb_args()
    lowered = f.lower(ws, x, y)
    cut = _host_cut(lowered.plan)
    # 4 microbatches of x to stage 0, 4 of y to stage 1 (the loss); neither whole
    assert sorted(p.stage for p in cut) == [0] * 4 + [1] * 4
    assert "8 of them slices cut on the host" in lowered.as_text()
    assert sorted(p.arg for p in lowered.plan.inputs if p.mode == "put") == [0, 1]
    want = reference(grad, mesh4x2, ws, x, y)
    assert_close(f(ws, x, y), want)
    assert_close(f(ws, jnp.asarray(x), jnp.asarray(y)), want)  # uncommitted arrays
    compiled = lowered.compile()
    assert_close(compiled(ws, x, y), want)
    far = jax.device_put(x, mesh4x2.submesh(3).devices.flat[1])
    with pytest.raises(ValueError, match="argument x.*compiled for it as a host value"):
        compiled(ws, far, y)
    assert_close(f(ws, far, y), want)  # the mm.jit function compiles for that placement


def test_host_cut_stacked_microbatches_and_plain_slices(mesh4x2):
    """``stacked=True`` microbatches (a slice and a squeeze) and a user's own static
    slice of a host argument are cut on the host too."""
    grad = _mb_grad(4, stacked=True)
    ws, x, y = _mb_args(stacked=True)
    f = mm.jit(grad, mesh=mesh4x2)
    assert len(_host_cut(f.lower(ws, x, y).plan)) == 8
    assert_close(f(ws, x, y), reference(grad, mesh4x2, ws, x, y))

    def g(x):
        with mm.task("a", stage=2):
            return x[1:3, ::2] * 2, x.sum()

    x = np.arange(24.0, dtype=np.float32).reshape(4, 6)
    gj = mm.jit(g, mesh=mesh4x2)
    assert len(_host_cut(gj.lower(x).plan)) == 1
    assert_close(gj(x), reference(g, mesh4x2, x))


def test_host_cut_not_where_a_layout_is_asked(mesh4x2):
    """A batch with ``in_shardings`` (mm.jit's or microbatch's) is put whole and sliced
    on its submesh, in the layout asked for."""
    ws, x, y = _mb_args()
    grad = _mb_grad(4)
    f = mm.jit(grad, mesh=mesh4x2, in_shardings=(None, jax.P("data"), None))
    plan = f.lower(ws, x, y).plan
    assert sorted(p.stage for p in _host_cut(plan)) == [1] * 4  # y only
    assert any(p.mode == "put" and p.arg == 2 for p in plan.inputs)
    assert_close(f(ws, x, y), reference(grad, mesh4x2, ws, x, y))
    grad = _mb_grad(4, in_shardings=jax.P("data"))
    f = mm.jit(grad, mesh=mesh4x2)
    assert not _host_cut(f.lower(ws, x, y).plan)
    assert_close(f(ws, x, y), reference(grad, mesh4x2, ws, x, y))


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
@pytest.mark.parametrize("spec", [jax.P(), jax.P("data")], ids=["replicated", "sharded"])
def test_targets_committed_to_an_earlier_stage_than_the_loss(mesh4x2, schedule, spec):
    """A data loader put the targets on stage 0 (or 1); the untagged loss uses them with
    the last stage's activations. The loss runs with the activations (the targets move
    before the loop): next to the targets, the last stage's microbatch work would come
    back to stage 0 and 1F1B's order would deadlock (found by a probe: "invalid
    schedule ... (deadlock)")."""
    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(4)]
    x = rng.normal(size=(8, 8)).astype(np.float32)
    y = np.sin(x)

    def step(ws, x, y):
        vg = jax.value_and_grad(mlp_loss)
        return mm.microbatch(vg, 4, argnums=(1, 2), schedule=schedule, reduce="mean")(ws, x, y)

    want = reference(step, mesh4x2, ws, x, y)
    f = mm.jit(step, mesh=mesh4x2)
    for stage in (0, 1):
        yd = jax.device_put(y, jax.sharding.NamedSharding(mesh4x2.submesh(stage), spec))
        assert_close(f(ws, x, yd), want)


@pytest.mark.parametrize("spec", [jax.P(), jax.P("data")], ids=["replicated", "sharded"])
def test_argument_on_a_submesh_in_another_device_order(mesh4x2, spec):
    """An argument on stage 0's devices listed in another order is not used as it is (a
    jitted program takes one device order): its shards are re-wrapped or it is put.
    (Found by a probe: JAX's "incompatible devices" error from inside a fragment.)"""
    x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
    w = np.eye(8, dtype=np.float32)

    def f(w, x):
        with mm.task("a", stage=0):
            h = jnp.tanh(x @ w)
        with mm.task("b", stage=1):
            return (h * 2).sum()

    devs = list(mesh4x2.submesh(0).devices.flat)[::-1]
    xr = jax.device_put(
        x, jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devs), ("data",)), spec)
    )
    want = reference(f, mesh4x2, w, x)
    g = mm.jit(f, mesh=mesh4x2)
    assert_close(g(w, xr), want)
    assert_close(g.lower(w, xr).compile()(w, xr), want)
    assert_close(
        jax.grad(lambda x: f(w, x))(x), mm.jit(jax.grad(lambda x: f(w, x)), mesh=mesh4x2)(xr)
    )


def test_arrays_already_in_the_submesh_layout_are_not_put(monkeypatch):
    """An uncommitted array, or one committed with another but equivalent sharding
    (``SingleDeviceSharding`` for a one-device submesh, a mesh of other axis names), on
    its submesh's devices is re-wrapped with the plan's sharding, not put with
    ``jax.device_put`` (no copy, a third of the host time)."""
    mmesh = mm.make_mesh((2, 2), ("stage", "d"), devices=jax.devices()[:4])
    one = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    puts = []
    real_put = jax.device_put

    def counting_put(x, *a, **k):
        puts.append(len(x) if isinstance(x, list) else 1)
        return real_put(x, *a, **k)

    def f(w, x):
        with mm.task("a", stage=0):
            h = jnp.tanh(x @ w)
        with mm.task("b", stage=1):
            return (h * 2).sum()

    w = np.eye(4, dtype=np.float32) / 2
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
    want = reference(f, one, w, x)
    monkeypatch.setattr(jax, "device_put", counting_put)
    sub = mmesh.submesh(0)
    other = jax.sharding.Mesh(sub.devices, tuple(f"other{i}" for i in range(sub.devices.ndim)))
    for mesh, wx in [
        (one, (jnp.asarray(w), jnp.asarray(x))),  # uncommitted, on device 0
        (one, (real_put(w, jax.devices()[0]), real_put(x, jax.devices()[0]))),
        (mmesh, tuple(real_put(a, jax.sharding.NamedSharding(other, P())) for a in (w, x))),
    ]:
        g = mm.jit(f, mesh=mesh)
        assert_close(g(*wx), want)  # builds (puts its constants)
        puts.clear()
        assert_close(g(*wx), want)
        assert puts == [], (mesh, puts)
        assert not any(a.is_deleted() for a in wx)
    # elsewhere (another device): put, as before
    g = mm.jit(f, mesh=one)
    far = tuple(real_put(a, jax.devices()[5]) for a in (w, x))
    assert_close(g(*far), want)
    puts.clear()
    assert_close(g(*far), want)
    assert puts and sum(puts) == 2, puts


def test_a_value_returned_twice_is_two_arrays(mesh4x2):
    """``return h, h`` gives two independent arrays, as under jax.jit: donating one leaves
    the other intact (found by a probe: one object, deleted with the other)."""
    w = jnp.eye(4) * 2
    x = jnp.ones((2, 4))

    def f(w, x):
        with mm.task("a", stage=0):
            h = jnp.tanh(x @ w)
        with mm.task("b", stage=1):
            g = h * 3
        return h, h, g, g

    o = mm.jit(f, mesh=mesh4x2)(w, x)
    assert o[0] is not o[1] and o[2] is not o[3]
    assert_close(o, reference(f, mesh4x2, w, x))
    mm.jit(lambda a: a + 1, mesh=mesh4x2, donate_argnums=0)(o[0])
    assert o[0].is_deleted() and not o[1].is_deleted()
    assert_close(o[1], jnp.tanh(x @ w))


def _skip_loss(ws, x, y):
    """A residual from stage 0 added after the last stage, untagged."""
    h = x
    for i, w in enumerate(ws):
        with mm.task(f"s{i}", stage=i):
            h = jnp.tanh(h @ w)
        if i == 0:
            h0 = h
    return jnp.mean((h + h0 - y) ** 2)


def _aux_loss(ws, x, y):
    """An auxiliary loss from stage 0's activations (an MoE balance loss), untagged and
    evaluated after the main loss."""
    h = x
    for i, w in enumerate(ws):
        with mm.task(f"s{i}", stage=i):
            h = h + jnp.tanh(h @ w)
        if i == 0:
            h0 = h
    return jnp.mean((h - y) ** 2) + 0.01 * jnp.mean(h0**2)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1", "interleaved-1f1b"])
@pytest.mark.parametrize("loss", [_skip_loss, _aux_loss], ids=["skip", "aux"])
def test_untagged_code_after_the_last_stage_using_stage_0(schedule, loss):
    """Untagged code joining the last stage's output with a value from stage 0 runs on the
    last stage (where the microbatch's data flows), not on stage 0, which would send each
    microbatch's forward back to stage 0 and deadlock 1F1B-style orders (found by a
    probe: "invalid schedule ... (deadlock)")."""
    rng = np.random.default_rng(3)
    n = 8 if schedule == "interleaved-1f1b" else 4
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(n)]
    x = rng.normal(size=(8, 8)).astype(np.float32)
    y = np.sin(x)
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])

    def step(ws, x, y):
        vg = jax.value_and_grad(loss)
        return mm.microbatch(vg, 4, argnums=(1, 2), schedule=schedule, reduce="mean")(ws, x, y)

    assert_close(mm.jit(step, mesh=mesh)(ws, x, y), reference(step, mesh, ws, x, y))


def test_untagged_parameter_between_stages_fed_back():
    """An untagged parameter used between two stages (a scale, a LayerNorm's weights)
    comes back from a step on a later stage; the next step broadcasts it where it is
    used (found by a probe: the second step was refused as a cycle)."""
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    rng = np.random.default_rng(4)
    ps = [
        (rng.normal(size=(8, 8)).astype(np.float32) / 3, np.full(8, 0.1, np.float32))
        for _ in range(4)
    ]
    s = np.full(8, 1.1, np.float32)
    x = rng.normal(size=(16, 8)).astype(np.float32)

    def loss(p, x):
        ps, s = p
        h = x
        for i, (w, b) in enumerate(ps):
            with mm.task(f"l{i}", stage=i):
                h = jnp.tanh(h @ w + b)
            if i == 1:
                h = h * s  # untagged
        return jnp.mean(h**2)

    g = mm.microbatch(jax.value_and_grad(loss), 2, argnums=1, schedule="1f1b", reduce="mean")

    def step(p, x):
        v, gr = g(p, x)
        return jax.tree.map(lambda a, d: a - 0.1 * d, p, gr), v

    mstep, jstep = mm.jit(step, mesh=mesh), jax.jit(step)
    mp = rp = (ps, s)
    for _ in range(3):
        mp, mv = mstep(mp, x)
        rp, rv = jstep(rp, x)
        assert_close((mp, mv), (rp, rv), rtol=1e-5, atol=1e-6)


def test_interleaved_untagged_aux_loss_from_a_later_chunk():
    """Interleaved 1F1B: an untagged auxiliary loss from virtual stage 5 (submesh 1's
    second chunk) belongs to that chunk, not the submesh's first (found by a probe: an
    invalid-schedule deadlock)."""
    rng = np.random.default_rng(5)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(8)]
    x = rng.normal(size=(8, 8)).astype(np.float32)
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])

    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"s{i}", stage=i):
                h = h + jnp.tanh(h @ w)
            if i == 5:
                aux = 0.01 * jnp.mean(h**2)
        return jnp.mean(h**2) + aux

    def step(ws, x):
        vg = jax.value_and_grad(loss)
        return mm.microbatch(vg, 4, argnums=1, schedule="interleaved-1f1b", reduce="mean")(ws, x)

    assert_close(mm.jit(step, mesh=mesh)(ws, x), reference(step, mesh, ws, x))


@pytest.mark.parametrize("pair", [(0, 3), (1, 5), (3, 4), (2, 7)])
def test_interleaved_untagged_aux_loss_mixing_two_chunks(pair):
    """Interleaved 1F1B: an untagged auxiliary loss mixing the outputs of two virtual
    stages. Its gradient needs only forward values (the seed is a constant), so it is
    backward work with no backward input; in its chunk's backward step it ran after a
    later chunk that consumes it (found by a probe: 13 of 28 pairs deadlocked). It now
    runs before its first consumer on the submesh."""
    i, j = pair
    rng = np.random.default_rng(6)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(8)]
    x = rng.normal(size=(8, 8)).astype(np.float32)
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])

    def loss(ws, x):
        h, hs = x, []
        for k, w in enumerate(ws):
            with mm.task(f"s{k}", stage=k):
                h = h + jnp.tanh(h @ w)
            hs.append(h)
        return jnp.mean(h**2) + 0.01 * jnp.mean(hs[i] * hs[j])

    def step(ws, x):
        vg = jax.value_and_grad(loss)
        return mm.microbatch(vg, 4, argnums=1, schedule="interleaved-1f1b", reduce="mean")(ws, x)

    assert_close(mm.jit(step, mesh=mesh)(ws, x), reference(step, mesh, ws, x))


@pytest.mark.parametrize(
    "nsub, chunks, M, aux",
    [(2, 3, 2, (1, 2, 3)), (4, 2, 8, (0, 6))],
    ids=["2x3-aux-per-layer", "4x2-M8-product"],
)
def test_interleaved_untagged_aux_consumed_on_another_submesh(nsub, chunks, M, aux):
    """Interleaved 1F1B: an untagged aux loss whose gradient is consumed by a chunk on
    another submesh, which the aux work's own submesh waits for through later steps (found
    by a helper's fuzzer: "invalid schedule ... deadlock"). The untagged work now runs at
    a point of its submesh's order that closes no cycle."""
    n = nsub * chunks
    rng = np.random.default_rng(10)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(n)]
    x = rng.normal(size=(2 * M, 8)).astype(np.float32)
    mesh = mm.make_mesh((nsub,), ("stage",), devices=jax.devices()[:nsub])

    def loss(ws, x):
        h, outs = x, []
        for i, w in enumerate(ws):
            with mm.task(f"l{i}", stage=i):
                h = jnp.tanh(h @ w)
            outs.append(h)
        total = jnp.mean(h**2)
        if len(aux) == 2:
            return total + 0.1 * jnp.mean(outs[aux[0]] * outs[aux[1]])
        for a in aux:
            total = total + 0.01 * jnp.mean(outs[a] ** 2)
        return total

    def step(ws, x):
        vg = jax.value_and_grad(loss)
        return mm.microbatch(vg, M, argnums=1, schedule="interleaved-1f1b", reduce="mean")(ws, x)

    assert_close(mm.jit(step, mesh=mesh)(ws, x), reference(step, mesh, ws, x), rtol=2e-5)


def test_single_device_in_shardings_name_that_devices_submesh(mesh4x2):
    """A SingleDeviceSharding in in_shardings means the submesh of that device (as a
    NamedSharding on it would); jax.jit takes one too."""
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    x = np.arange(4.0, dtype=np.float32)
    want = np.asarray(jax.jit(two_stage)(x, x))
    for d in (0, 1):
        sd = jax.sharding.SingleDeviceSharding(jax.devices()[d])
        g = mm.jit(two_stage, mesh=mesh, in_shardings=(sd, None))
        np.testing.assert_array_equal(g(x, x), want)
        np.testing.assert_array_equal(g(jax.device_put(x, sd), x), want)


def test_donating_a_captured_constant_donates_a_copy(mesh4x2):
    """An argument donated while the function also captures that array: the program
    needs the constant in this call and the next, so a copy is donated (with jax.jit's
    kind of warning) instead of failing at run time."""
    c = jnp.arange(4.0)

    def f(x):
        with mm.task("a", stage=0):
            h = x * c
        with mm.task("b", stage=1):
            return h + c

    g = mm.jit(f, mesh=mesh4x2, donate_argnums=0)
    with pytest.warns(UserWarning, match=r"argument\(s\) \['x'\] are donated.*captures"):
        np.testing.assert_array_equal(g(c), np.arange(4.0) ** 2 + np.arange(4.0))
    assert not c.is_deleted()
    y = jnp.ones(4)
    np.testing.assert_array_equal(g(y), np.arange(4.0) * 2)  # the constant is intact
    assert y.is_deleted()


def test_overflowing_python_int_names_the_argument(mesh4x2):
    def f(x, b):
        return two_stage(x * b, x)

    g = mm.jit(f, mesh=mesh4x2)
    x = jnp.ones(4)
    np.testing.assert_array_equal(g(x, 2), np.full(4, 5.0))
    with pytest.raises(OverflowError, match="argument path is b"):
        g(x, 2**40)


def test_sub_byte_values_run_or_say_why(mesh4x2):
    """int4 arguments and values between stages: right where this JAX can pass them
    into compiled programs (0.12), a clear error naming the fragment where it cannot
    (0.10's compiled calls refuse their layouts, also for plain jax.jit AOT calls)."""

    def f(a, y):
        with mm.task("a", stage=0):
            h = (a.astype(jnp.float32) * 2).astype(jnp.int4)
        with mm.task("b", stage=1):
            return h.astype(jnp.float32) * y

    a, y = jnp.ones(4, jnp.int4), jnp.arange(4.0)
    g = mm.jit(f, mesh=mesh4x2)
    if _compat.sub_byte_inputs_work():
        np.testing.assert_array_equal(g(a, y), jax.jit(f)(a, y))
    else:
        with pytest.raises(ValueError, match=r"fragment 'a' .*dtype int4.*upgrade jax"):
            g(a, y)


def test_in_shardings_mismatch_names_an_argument_without_leaves(mesh4x2):
    """An ``in_shardings`` entry that does not fit an argument without leaves (``()``)
    names its position (it was called ``'?'``; found by a probe)."""

    def f(x, e):
        with mm.task("a", stage=0):
            return x * 2

    g = mm.jit(f, mesh=mesh4x2, in_shardings=(None, (P(), P())))
    with pytest.raises(ValueError, match=r"in_shardings for argument at position 1 .*prefix"):
        g(jnp.ones(4), ())
