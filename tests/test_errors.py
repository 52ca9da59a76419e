"""Bad input gets a clear error naming the task and the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, reference
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh as mm


def run(f, mmesh, *args):
    return mm.jit(f, mesh=mmesh)(*args)


def test_stage_out_of_range(mesh4x2):
    def f(x):
        with mm.task("late", stage=4):
            return x + 1

    with pytest.raises(ValueError, match=r"task 'late'.*stage=4.*out of range.*4 stages"):
        run(f, mesh4x2, jnp.ones(2))
    with pytest.raises(ValueError, match="out of range"):
        run(lambda x: mm.task(lambda y: y, name="neg", stage=-1)(x), mesh4x2, jnp.ones(2))


def test_stage_without_multimesh():
    def f(x):
        with mm.task("t", stage=0):
            return x + 1

    with pytest.raises(ValueError, match=r"task 't'.*stage=0 needs a MultiMesh under mm.jit"):
        mm.jit(f)(jnp.ones(2))
    np.testing.assert_allclose(f(jnp.ones(2)), 2.0)  # outside mm.jit a task is transparent


def test_both_or_neither(mesh4x2):
    with pytest.raises(ValueError, match="exactly one of stage= or mesh="):
        mm.task("t")
    with pytest.raises(ValueError, match="exactly one of stage= or mesh="):
        mm.task("t", stage=0, mesh=mesh4x2.submesh(0))
    with pytest.raises(TypeError, match="stage must be an int"):
        with mesh4x2, mm.task("t", stage="0"):
            pass


def test_nested_tasks(mesh4x2):
    def f(x):
        with mm.task("outer", stage=0):
            with mm.task("inner", stage=1):
                return x + 1

    with pytest.raises(ValueError, match=r"task 'inner' is nested inside task 'outer'"):
        run(f, mesh4x2, jnp.ones(2))


def test_nested_via_cached_inner_jit(mesh4x2):
    @jax.jit
    def inner(x):
        with mm.task("inner", stage=1):
            return x * 2

    with mesh4x2:
        inner(jnp.ones(2))  # traced (and cached) outside any task

    def f(x):
        with mm.task("outer", stage=0):
            return inner(x)

    with pytest.raises(ValueError, match="nested"):
        run(f, mesh4x2, jnp.ones(2))


def test_tasks_in_cond_branches(mesh4x2):
    """Tasks in the branches of one lax.cond run there if they share a submesh (found by
    a probe: reported as nested); on different submeshes the cond cannot be split: a
    clear error naming the tasks."""
    w = jnp.eye(4) / 2
    x = jnp.arange(8.0).reshape(2, 4)

    def f(x, second_stage):
        with mm.task("a", stage=0):
            h = x @ w

        def yes(h):
            with mm.task("b", stage=1):
                return h @ w

        def no(h):
            with mm.task("c", stage=second_stage):
                return h * 2

        return jax.lax.cond(h.sum() > 0, yes, no, h).sum()

    g = mm.jit(f, mesh=mesh4x2, static_argnums=1)
    for xs in (x, -x):
        np.testing.assert_allclose(g(xs, 1), reference(lambda v: f(v, 1), mesh4x2, xs), rtol=1e-6)
    with pytest.raises(ValueError, match=r"\['b', 'c'\] sit inside a `cond` body .* one stage"):
        g(x, 2)


def test_pipeline_coming_back_to_a_stage_names_the_tasks():
    """A tied head put back on the embedding's stage makes each microbatch's forward pass
    return to stage 0: not a chain. The error names the tasks per stage and the fix."""
    mesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    emb, w = jnp.ones((16, 8)) / 8, jnp.eye(8)
    tok = jnp.arange(8) % 16

    def loss(p, tok):
        emb, w = p
        with mm.task("embed", stage=0):
            h = emb[tok]
        with mm.task("layer", stage=1):
            h = jnp.tanh(h @ w)
        with mm.task("head", stage=0):
            logits = h @ emb.T
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    g = mm.microbatch(jax.value_and_grad(loss), 2, argnums=1)
    with pytest.raises(ValueError, match=r"stage 0: \['embed', 'head'\]; stage 1: \['layer'\]"):
        mm.jit(g, mesh=mesh)((emb, w), tok)


def test_overlapping_meshes():
    devs = jax.devices()
    a = Mesh(np.array(devs[:4]), ("d",), axis_types=(AxisType.Auto,))
    b = Mesh(np.array(devs[2:6]), ("d",), axis_types=(AxisType.Auto,))

    def f(x):
        with mm.task("a", mesh=a):
            y = x + 1
        with mm.task("b", mesh=b):
            return y * 2

    with pytest.raises(ValueError, match=r"task 'b'.*overlaps the devices of task 'a'"):
        mm.jit(f)(jnp.ones(4))


def test_mesh_overlapping_a_stage(mesh4x2):
    odd = Mesh(np.array(jax.devices()[1:3]), ("d",), axis_types=(AxisType.Auto,))

    def f(x):
        with mm.task("first", stage=0):
            x = x * 3
        with mm.task("odd", mesh=odd):
            return x + 1

    with pytest.raises(
        ValueError, match=r"task 'odd'.*overlaps the devices of task 'first' \(stage 0\)"
    ):
        run(f, mesh4x2, jnp.ones(4))


def test_mesh_task_reshaping_a_used_submesh(mesh222):
    line = Mesh(np.array(jax.devices()[4:]), ("model",), axis_types=(AxisType.Auto,))

    def f(x):
        with mm.task("s1", stage=1):
            x = x * 3
        with mm.task("flat", mesh=line):  # submesh 1's devices, in order, as 1-D
            return x + 1

    with pytest.raises(
        ValueError,
        match=r"task 'flat'.*shape \{'model': 4\}\) overlaps the devices of task 's1' "
        r"\(stage 1\).*same order and mesh shape",
    ):
        run(f, mesh222, jnp.ones(4))


def test_mesh_tasks_on_submeshes_no_stage_task_uses(mesh4x2):
    """mesh= tasks on part of (or across) MultiMesh submeshes that no stage= task uses
    run (every submesh reserved its devices, even unused ones); values and gradients as
    under jax.jit."""
    devs = np.array(jax.devices())
    across = Mesh(devs[3:5], ("d",), axis_types=(AxisType.Auto,))  # stages 1 and 2
    part = Mesh(devs[6:7], ("d",), axis_types=(AxisType.Auto,))  # half of stage 3

    def f(w, x):
        with mm.task("first", stage=0):
            h = jnp.tanh(x @ w)
        with mm.task("across", mesh=across):
            h = jax.lax.with_sharding_constraint(h * 2, NamedSharding(across, jax.P("d")))
        with mm.task("part", mesh=part):
            return jnp.sum(h**2)

    w = jnp.linspace(-1, 1, 16).reshape(4, 4)
    x = jnp.linspace(0, 1, 32).reshape(8, 4)
    g = jax.value_and_grad(f)
    got = mm.jit(g, mesh=mesh4x2)(w, x)
    assert_close(got, jax.jit(g)(w, x), rtol=1e-6)
    plan = mm.jit(g, mesh=mesh4x2).lower(w, x).plan
    assert {tuple(fr.devices) for fr in plan.fragments} == {(0, 1), (3, 4), (6,)}
    # asked for on the global mesh: moved there (a shard-wise copy per submesh crashed)
    everywhere = NamedSharding(mesh4x2.mesh, P())
    out = mm.jit(f, mesh=mesh4x2, out_shardings=everywhere)(w, x)
    assert out.sharding == everywhere
    assert_close(out, jax.jit(f)(w, x), rtol=1e-6)


def test_foreign_devices():
    small = mm.make_mesh((2, 2), ("stage", "data"), devices=jax.devices()[:4])
    other = Mesh(np.array(jax.devices()[4:6]), ("d",), axis_types=(AxisType.Auto,))

    def f(x):
        with mm.task("far", mesh=other):
            return x + 1

    with pytest.raises(ValueError, match=r"task 'far'.*not in the MultiMesh"):
        run(f, small, jnp.ones(4))


def test_spec_naming_stage_axis(mesh4x2):
    def f(x):
        with mm.task("t", stage=0):
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh4x2.mesh, P("stage")))

    with pytest.raises(ValueError, match=r"task 't'.*names the stage axis 'stage'"):
        run(f, mesh4x2, jnp.ones(8))


def test_global_sharding_axis_missing_in_mesh_task():
    """A global-mesh NamedSharding inside a mesh= task whose mesh lacks its axes: a clear
    error naming the task (was JAX's "Resource axis ... not found" from compiling)."""
    mmesh = mm.make_mesh((2, 2, 2), ("stage", "data", "model"))
    devs = jax.devices()
    other = Mesh(np.array([devs[4], devs[6]]), ("q",), axis_types=(AxisType.Auto,))

    def f(x):
        with mm.task("a", stage=0):
            h = x * 3
        with mm.task("b", mesh=other):
            return jax.lax.with_sharding_constraint(h * 2, NamedSharding(mmesh.mesh, P("data")))

    with pytest.raises(ValueError, match=r"task 'b'.*names axes \['data'\].*\{'q': 2\}"):
        mm.jit(f, mesh=mmesh)(jnp.ones((4, 4)))


def test_sharding_on_other_submesh(mesh4x2):
    def f(x):
        with mm.task("t", stage=0):
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh4x2.submesh(1), P("data")))

    with pytest.raises(ValueError, match=r"task 't'.*runs on the submesh"):
        run(f, mesh4x2, jnp.ones(8))


def test_explicit_axes():
    devs = np.array(jax.devices()).reshape(2, 4)
    mesh = Mesh(devs, ("stage", "data"), axis_types=(AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match="Explicit"):
        mm.MultiMesh(mesh)
    explicit = Mesh(devs[0], ("d",), axis_types=(AxisType.Explicit,))

    def f(x):
        with mm.task("t", mesh=explicit):
            return jnp.tanh(x) * 2

    x = jnp.ones(8)
    # outside mm.jit a task is a named scope only: JAX runs the code as it would
    assert_close(f(x), jnp.tanh(x) * 2)
    assert_close(jax.jit(f)(x), jnp.tanh(x) * 2)
    with pytest.raises(ValueError, match="task 't': its mesh has Explicit axes"):
        mm.jit(f)(x)
    with pytest.raises(ValueError, match="task 't': its mesh has Explicit axes"):
        mm.jit(lambda x: jax.jit(f)(x) + 1)(x)  # traced by jax.jit before, cached
    # Manual axes (shard_map's) were accepted, then JAX's "not allowed when using
    # jax.set_mesh" at the first call
    manual = Mesh(devs, ("stage", "data"), axis_types=(AxisType.Manual,) * 2)
    with pytest.raises(ValueError, match="does not support Manual mesh axes"):
        mm.MultiMesh(manual)


def test_bad_multimesh_args():
    with pytest.raises(ValueError, match="stage_axis 'pipe' is not an axis"):
        mm.make_mesh((2, 4), ("stage", "data"), stage_axis="pipe")
    with pytest.raises(ValueError, match="needs 16 devices"):
        mm.make_mesh((4, 4), ("stage", "data"))
    with pytest.raises(TypeError, match="takes a MultiMesh"):
        mm.jit(lambda x: x, mesh=mm.make_mesh((2, 4), ("stage", "data")).mesh)
    with pytest.raises(ValueError, match=r"lists devices \[0, 1\] more than once"):
        mm.make_mesh((2, 2), ("stage", "data"), devices=jax.devices()[:2] * 2)


class _OtherPlatformDevice:
    """Stands for an accelerator beside the CPU devices: its id repeats a CPU device's."""

    platform, id, process_index = "tpu", 0, 0


def test_a_multimesh_of_several_platforms_is_refused():
    # A TPU or GPU host also has CPU devices, numbered from 0 as well: a mesh mixing them
    # was refused as "lists devices [0] more than once" (seen on a TPU machine).
    mixed = Mesh(
        np.array([_OtherPlatformDevice(), jax.devices()[1]], dtype=object),
        ("stage",),
        axis_types=(AxisType.Auto,),
    )
    with pytest.raises(ValueError, match=r"mixes devices of several platforms \(cpu, tpu\)"):
        mm.MultiMesh(mixed)


def test_task_in_scan_across_stages(mesh4x2):
    def f(x):
        def body(c, _):
            with mm.task("a", stage=0):
                c = c + 1
            with mm.task("b", stage=1):
                c = c * 2
            return c, None

        return jax.lax.scan(body, x, None, length=2)[0]

    with pytest.raises(ValueError, match=r"\['a', 'b'\].*`scan`.*cannot split a loop"):
        run(f, mesh4x2, jnp.ones(2))


def test_task_in_scan_with_outside_work(mesh4x2):
    def f(x):
        def body(c, _):
            with mm.task("a", stage=1):
                c = c + 1
            return c * 2, None  # untagged work inside the same loop body

        with mm.task("pre", stage=0):
            x = x * 3
        return jax.lax.scan(body, x, None, length=2)[0]

    # one task in the loop body: the loop runs on that task's submesh
    got = run(f, mesh4x2, jnp.ones(2))
    with mesh4x2:
        want = jax.jit(f)(jnp.ones(2))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want))


def test_bad_arguments_are_named(mesh4x2):
    """A non-array argument and an int overflowing int32 name the argument, as jax.jit
    does (they said only "arguments" and ``leaves[1]``)."""

    def f(x, n):
        with mm.task("a", stage=0):
            return x * n

    g = mm.jit(f, mesh=mesh4x2)
    with pytest.raises(TypeError, match="argument n: mm.jit arguments must be arrays"):
        g(jnp.ones(3), "text")
    with pytest.raises(OverflowError, match="argument path is n"):
        g(jnp.ones(3), 2**40)
    # NumPy arrays JAX cannot take (object dtype, big-endian): jax.jit's message, naming
    # f and x (they named MpmdFunction._trace.<locals>.flat_fun and leaves[0])
    for bad in (np.array([1, "a"], dtype=object), np.arange(3, dtype=">f4")):
        with pytest.raises(TypeError) as got:
            g(bad, 2.0)
        text = str(got.value)
        assert f"Error interpreting argument to {f!r}" in text, text
        assert "at path x" in text and "flat_fun" not in text, text


def test_mutable_array_references(mesh4x2):
    """jax.new_ref: within one task it runs (as under jax.jit); as an argument, or used
    across tasks, a clear error instead of JAX's internal ones."""
    x = jnp.ones((8, 4))

    def inside(x):
        with mm.task("a", stage=0):
            r = jax.new_ref(jnp.zeros_like(x))
            r[...] += x
            h = r[...] * 2
        with mm.task("b", stage=1):
            return h + 1

    np.testing.assert_allclose(run(inside, mesh4x2, x), jax.jit(inside)(x))

    def arg(r, x):
        with mm.task("a", stage=0):
            r[...] += x
        with mm.task("b", stage=1):
            return x * 3

    with pytest.raises(TypeError, match=r"argument r: a mutable array reference"):
        run(arg, mesh4x2, jax.new_ref(jnp.zeros_like(x)), x)

    def across(x):
        r = jax.new_ref(jnp.zeros_like(x))
        with mm.task("a", stage=0):
            r[...] += x
        with mm.task("b", stage=1):
            r[...] *= 3
        return r[...]

    with pytest.raises(ValueError, match=r"reference .* cannot cross tasks"):
        run(across, mesh4x2, x)


@pytest.mark.parametrize(
    "shape, names, words",
    [
        ((2, 2, 2), ("stage", "d", "d"), r"name \['d'\] more than once"),
        ((2, 4), ("stage", "stage"), r"name \['stage'\] more than once"),
        ((-1, 4), ("stage", "d"), r"positive int.*got \[-1\]"),
        ((0, 4), ("stage", "d"), r"positive int.*got \[0\]"),
        ((2.5, 4), ("stage", "d"), r"positive int.*got \[2.5\]"),
    ],
)
def test_make_mesh_refuses_bad_shapes_and_repeated_axes(shape, names, words):
    """Repeated axis names crashed XLA when compiling for a submesh (a segfault on jax
    0.10); -1, 0 and fractions made odd meshes silently."""
    with pytest.raises(ValueError, match=words):
        mm.make_mesh(shape, names)


def test_multimesh_refuses_repeated_axis_names():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("stage", "d", "d"))
    with pytest.raises(ValueError, match=r"names axes \['d'\] more than once"):
        mm.MultiMesh(mesh)


def test_task_rules_keys_must_be_regexes():
    with pytest.raises(TypeError, match="task_rules keys are regexes"):
        mm.jit(lambda x: x, task_rules={1: 1})


def test_transfer_guard_applies_to_the_callers_transfers_not_the_plans(mesh4x2):
    """Moves between submeshes are the program's own (as jax.jit's collectives): a
    caller's jax.transfer_guard does not refuse them, as it did every multi-stage call."""

    def f(x):
        with mm.task("a", stage=0):
            y = jnp.tanh(x)
        with mm.task("b", stage=1):
            return y * 3

    g = mm.jit(f, mesh=mesh4x2)
    xs = jax.device_put(jnp.arange(8.0), NamedSharding(mesh4x2.submesh(0), P()))
    want = reference(f, mesh4x2, jnp.arange(8.0))
    g(xs)
    for mode in ("disallow", "disallow_explicit"):
        with jax.transfer_guard(mode):
            assert_close(g(xs), want)
            out, _timeline = g.record(xs)
            assert_close(out, want)
    with jax.transfer_guard("disallow_explicit"), pytest.raises(Exception, match="Disallowed"):
        jax.device_put(xs, NamedSharding(mesh4x2.submesh(1), P()))  # the caller's own
    # a host argument is the caller's transfer: refused, as jax.jit refuses it
    g(np.ones(8, np.float32))
    with (
        jax.transfer_guard("disallow"),
        pytest.raises(ValueError, match="Disallowed host-to-device transfer: argument x"),
    ):
        g(np.ones(8, np.float32))


def test_a_tracer_leaked_from_an_earlier_trace_is_jaxs_unexpected_tracer_error():
    """A tracer one mm.jit trace stored in a global, closed over by another traced
    function: JAX's UnexpectedTracerError, as under jax.jit (was a low-level
    InvalidInputException from putting the tracer on a device)."""
    mesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    leaked = []

    def leak(w, x):
        with mm.task("a", stage=0):
            h = x @ w
        leaked.append(h)
        with mm.task("b", stage=1):
            return jnp.sum(h)

    w, x = jnp.eye(4), jnp.ones((8, 4))
    mm.jit(leak, mesh=mesh)(w, x)

    def use(w, x):
        with mm.task("a", stage=0):
            return jnp.sum(x @ w + leaked[0])

    with pytest.raises(jax.errors.UnexpectedTracerError, match="float32\\[8,4\\]"):
        jax.jit(use)(w, x)
    with pytest.raises(jax.errors.UnexpectedTracerError, match="float32\\[8,4\\]"):
        mm.jit(use, mesh=mesh)(w, x)


@pytest.mark.parametrize("bad", ["x", 1.0, None, (), [0, "a"], True])
def test_microbatch_argnums_checked(bad):
    """argnums must name batch arguments: other types were Python's own TypeErrors from
    inside the call, and ``()`` silently ran fun on the whole batch M times."""
    with pytest.raises(TypeError, match=r"microbatch argnums must be an int or a non-empty"):
        mm.microbatch(lambda w, x: (w * x).sum(), 2, argnums=bad)


@pytest.mark.parametrize("nums", [1, -1, np.int64(1), [1], (1,), range(1, 2), np.array([1])])
def test_microbatch_argnums_forms(nums):
    """Every form jax.grad takes for argnums works (range and NumPy arrays were refused
    by the check's first version)."""
    g = mm.microbatch(lambda w, x: (w * x).sum(), 2, argnums=nums)
    assert_close(g(jnp.ones(4), jnp.arange(8.0).reshape(2, 4)), jnp.arange(8.0).sum())


def test_microbatch_batch_arguments_without_arrays():
    g = mm.microbatch(lambda w, x: (w * x["a"]).sum() if x else w.sum(), 2, argnums=1)
    with pytest.raises(ValueError, match=r"argnums=\(1,\): the batch arguments hold no arrays"):
        g(jnp.ones(4), {})
