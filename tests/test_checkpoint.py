"""Orbax checkpoints of MPMD state: resume exactly, restore into other layouts, faults."""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import stage_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh as mm

ROOT = Path(__file__).resolve().parents[1]


def program(stages: int, layers: int = 4, tp: bool = False):
    opt = optax.adam(1e-2)

    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"s{i}", stage=i * stages // layers):
                z = h @ w
                if tp:
                    z = jax.lax.with_sharding_constraint(z, P(None, "model"))
                h = h + jnp.tanh(z)
        return (h**2).mean()

    def step(state, x):
        ws, o = state
        v, g = jax.value_and_grad(loss)(ws, x)
        u, o = opt.update(g, o, ws)
        return (optax.apply_updates(ws, u), o), v

    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(layers)]
    return step, (ws, opt.init(ws))


def batch(i: int) -> np.ndarray:
    return np.random.default_rng(100 + i).normal(size=(8, 8)).astype(np.float32)


def same_bits(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_restore_continue_equals_uninterrupted(mesh4x2, tmp_path):
    step, state = program(4)
    f = mm.jit(step, mesh=mesh4x2)
    losses, s = [], state
    with mm.checkpoint.CheckpointManager(tmp_path / "ck", max_to_keep=2) as man:
        for i in range(5):
            s, v = f(s, batch(i))
            losses.append(float(v))
            man.save(i + 1, s)  # asynchronous: the next step runs while it writes
        man.wait_until_finished()
        assert man.all_steps() == [4, 5] and man.latest_step() == 5
        # the latest step, into a differently placed target (host arrays -> numpy)
        restored = man.restore(target=jax.tree.map(np.asarray, state))
        same_bits(restored, s)
        with pytest.raises(FileNotFoundError, match="no complete checkpoint for step 3"):
            man.restore(3, target=state)  # pruned (max_to_keep=2)
    # from scratch: run 3 steps, save, restore into the live state's layout, continue
    s = state
    for i in range(3):
        s, _ = f(s, batch(i))
    mm.checkpoint.save(tmp_path / "step3", s, step=3)
    r = mm.checkpoint.restore(tmp_path / "step3", target=s)
    assert [x.sharding for x in jax.tree.leaves(r)] == [x.sharding for x in jax.tree.leaves(s)]
    same_bits(r, s)
    resumed = []
    for i in range(3, 5):
        r, v = f(r, batch(i))
        resumed.append(float(v))
    assert resumed == losses[3:5]


def test_restore_into_other_layouts(tmp_path):
    four = mm.make_mesh((4, 2), ("stage", "data"))
    two_tp = mm.make_mesh((2, 2, 2), ("stage", "data", "model"))
    step4, state = program(4)
    s4, _ = mm.jit(step4, mesh=four)(state, batch(0))
    mm.checkpoint.save(tmp_path / "four", s4)
    # 4 stages -> 2 stages x TP2: the target is what the 2-stage program returns
    step2, _ = program(2, tp=True)
    f2 = mm.jit(step2, mesh=two_tp)
    s2_template, _ = f2(state, batch(0))
    s2 = mm.checkpoint.restore(tmp_path / "four", target=s2_template)
    same_bits(s2, s4)
    assert stage_of(s2[0][3], two_tp) == 1 and stage_of(s2[0][0], two_tp) == 0
    s2, _ = f2(s2, batch(1))  # trains on in the new layout
    mm.checkpoint.save(tmp_path / "two", s2)
    # 2 stages x TP2 -> one device (a plain jax.jit run), and back to 4 stages
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target1 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), s2)
    s1 = mm.checkpoint.restore(tmp_path / "two", target=target1)
    same_bits(s1, s2)
    assert all(x.sharding == one for x in jax.tree.leaves(s1))
    s1, _ = jax.jit(step4)(s1, batch(2))
    mm.checkpoint.save(tmp_path / "one", s1)
    back = mm.checkpoint.restore(tmp_path / "one", target=s4)
    same_bits(back, s1)
    assert [x.sharding for x in jax.tree.leaves(back)] == [x.sharding for x in jax.tree.leaves(s4)]


def test_stage_sharded_arrays(mesh4x2, tmp_path):
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh4x2.mesh, P("stage")))
    mm.checkpoint.save(tmp_path / "c", {"stacked": x})
    target = {"stacked": jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                              sharding=NamedSharding(mesh4x2.submesh(2), P()))}
    r = mm.checkpoint.restore(tmp_path / "c", target)
    same_bits(r["stacked"], x)
    assert stage_of(r["stacked"], mesh4x2) == 2


def test_mismatched_checkpoints_are_clear_errors(tmp_path):
    state = {"a": jnp.ones((2, 3)), "b": {"c": jnp.zeros(4, jnp.int32)}}
    mm.checkpoint.save(tmp_path / "c", state)
    with pytest.raises(ValueError, match=r"a: shape \(2, 3\) in the checkpoint, \(3, 2\) wanted"):
        mm.checkpoint.restore(tmp_path / "c", {"a": jnp.ones((3, 2)), "b": state["b"]})
    with pytest.raises(ValueError, match=r"b/c: dtype int32 in the checkpoint, float32 wanted"):
        mm.checkpoint.restore(tmp_path / "c", {"a": state["a"], "b": {"c": jnp.zeros(4)}})
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['b/d'\]"):
        mm.checkpoint.restore(tmp_path / "c", {**state, "b": {**state["b"], "d": jnp.ones(1)}})
    with pytest.raises(ValueError, match=r"in the checkpoint but not in the target: \['b/c'\]"):
        mm.checkpoint.restore(tmp_path / "c", {"a": state["a"], "b": {}})
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        mm.checkpoint.restore(tmp_path / "nothing", state)
    # corrupt array data, then corrupt metadata: clear errors, never wrong values
    big = {"a": jnp.arange(100_000.0)}
    mm.checkpoint.save(tmp_path / "broken", big)
    for p in (tmp_path / "broken").rglob("*"):
        if p.is_file() and p.parent.name == "d" and p.parent.parent.name.startswith("ocdbt"):
            p.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="could not be restored"):
        mm.checkpoint.restore(tmp_path / "broken", big)
    (tmp_path / "c" / "_METADATA").write_text("garbage")
    with pytest.raises(ValueError, match="unreadable or corrupt"):
        mm.checkpoint.restore(tmp_path / "c", state)


def test_a_damaged_latest_step_names_the_earlier_ones(tmp_path):
    """A manager's latest step whose array data is gone: the error says which earlier
    steps are complete and how to restore one."""
    state = {f"w{i}": jnp.ones((4, 4)) * i for i in range(3)}
    with mm.checkpoint.CheckpointManager(tmp_path / "ck") as man:
        man.save(1, state)
        man.save(2, state)
    for p in (tmp_path / "ck" / "2").rglob("*"):
        if p.is_file() and p.parent.name == "d":
            p.unlink()
    man = mm.checkpoint.CheckpointManager(tmp_path / "ck")
    with pytest.raises(ValueError, match=r"[^.]\. (If this step is damaged, e|E)arlier complete "
                       r"steps: \[1\]; restore one with restore\(step=1, target=...\)\.$"):
        man.restore(target=state)
    got = man.restore(step=1, target=state)
    np.testing.assert_array_equal(got["w2"], state["w2"])


def test_killed_during_save_restores_previous_step(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal
        import jax, numpy as np
        jax.config.update("jax_platforms", "cpu")
        import multimesh as mm
        man = mm.checkpoint.CheckpointManager({str(tmp_path / "ck")!r})
        man.save(1, {{"w": np.full((1000, 1000), 1.0, np.float32)}})
        man.wait_until_finished()
        big = {{"w": np.full((1000, 1000), 2.0, np.float32),
               "more": [np.full((1000, 1000), float(i), np.float32) for i in range(60)]}}
        man.save(2, big)  # asynchronous: writing in the background...
        os.kill(os.getpid(), signal.SIGKILL)  # ... when the process dies
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == -9
    leftovers = [p.name for p in (tmp_path / "ck").iterdir()]
    assert any("tmp" in n for n in leftovers) or "2" not in leftovers, leftovers
    with mm.checkpoint.CheckpointManager(tmp_path / "ck") as man:
        assert man.latest_step() == 1
        r = man.restore(target={"w": np.zeros((1000, 1000), np.float32)})
    assert np.all(np.asarray(r["w"]) == 1.0)




def test_key_on_a_one_device_submesh_restores_usable(tmp_path):
    """A typed key on a one-device submesh (an NNX model's dropout Rngs on a (4, 1)
    mesh) restored as ``P(None,)`` on jax 0.10, which a fresh mm.jit step refused ("only
    valid for values of rank at least 1"); such a key made by ``wrap_key_data`` is taken
    too, as jax.jit takes it."""
    mmesh = mm.make_mesh((4, 1), ("stage", "data"))
    sh = NamedSharding(mmesh.submesh(1), P())
    state = {"key": jax.device_put(jax.random.key(3), sh), "w": jax.device_put(jnp.ones(2), sh)}
    mm.checkpoint.save(tmp_path / "c", state)
    got = mm.checkpoint.restore(tmp_path / "c", state)
    assert got["key"].sharding.spec == P()

    def f(s):
        with mm.task("a", stage=1):
            return s["w"] * jax.random.normal(s["key"], (2,))

    want = jax.jit(f)(state)
    np.testing.assert_array_equal(mm.jit(f, mesh=mmesh)(got), want)
    data = jax.device_put(jax.random.key_data(state["key"]), NamedSharding(mmesh.submesh(1), P(None)))
    wrapped = {"key": jax.random.wrap_key_data(data), "w": state["w"]}
    np.testing.assert_array_equal(mm.jit(f, mesh=mmesh)(wrapped), want)
    # a size-1 axis past the rank splits nothing either (P('data',) on a rank-0 key)
    data = jax.device_put(jax.random.key_data(state["key"]), NamedSharding(mmesh.submesh(1), P("data")))
    wrapped = {"key": jax.random.wrap_key_data(data), "w": state["w"]}
    np.testing.assert_array_equal(mm.jit(f, mesh=mmesh)(wrapped), want)

    def g(a, b, w):
        with mm.task("a", stage=1):
            return w * jax.random.normal(a, (2,)) + jax.random.normal(b, (2,))

    # re-labelled once: the same key donated and passed again is still the clear error
    with pytest.raises(ValueError, match="argument a is donated .* also passed as b"):
        mm.jit(g, mesh=mmesh, donate_argnums=0)(wrapped["key"], wrapped["key"], state["w"])


def test_keys_weak_types_and_strings_round_trip(mesh4x2, tmp_path):
    """Typed PRNG keys (saved as their key data) restore as keys on the target's
    sharding, weakly typed scalars stay weak, strings come back (each failed before)."""
    sh = NamedSharding(mesh4x2.submesh(1), P())
    state = {
        "w": jax.device_put(jnp.ones(4, jnp.bfloat16), sh),
        "rng": jax.device_put(jax.random.split(jax.random.key(7), 3), sh),
        "lr": jax.device_put(jnp.asarray(0.5), sh),
        "tag": "run-7",
    }
    assert state["lr"].weak_type
    mm.checkpoint.save(tmp_path / "c", state)
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=a.sharding, weak_type=getattr(a, "weak_type", False)
        )
        if isinstance(a, jax.Array)
        else a,
        state,
    )
    for target in (state, abstract):
        got = mm.checkpoint.restore(tmp_path / "c", target)
        assert got["tag"] == "run-7"
        assert jax.dtypes.issubdtype(got["rng"].dtype, jax.dtypes.prng_key)
        np.testing.assert_array_equal(
            jax.random.key_data(got["rng"]), jax.random.key_data(state["rng"])
        )
        assert got["rng"].sharding.is_equivalent_to(sh, 1)
        assert got["lr"].weak_type and got["lr"].dtype == jnp.float32
        assert (got["w"] * got["lr"]).dtype == jnp.bfloat16


def test_zero_size_arrays_round_trip(mesh4x2, tmp_path):
    """Orbax refuses zero-size arrays; they hold no data, so they are saved as nothing and
    made again in the target's layout (keys and numpy leaves too)."""
    sh = NamedSharding(mesh4x2.submesh(1), P())
    state = {
        "w": jax.device_put(jnp.ones(4), sh),
        "empty": jax.device_put(jnp.zeros((0, 3)), sh),
        "keys": jax.random.split(jax.random.key(0), 0),
        "host": np.zeros((2, 0), np.int32),
    }
    mm.checkpoint.save(tmp_path / "c", state)
    got = mm.checkpoint.restore(tmp_path / "c", state)
    assert got["empty"].shape == (0, 3) and got["empty"].sharding.is_equivalent_to(sh, 2)
    assert jax.dtypes.issubdtype(got["keys"].dtype, jax.dtypes.prng_key)
    assert got["keys"].shape == (0,)
    assert isinstance(got["host"], np.ndarray) and got["host"].shape == (2, 0)
    np.testing.assert_array_equal(got["w"], state["w"])
    with pytest.raises(ValueError, match="missing from the checkpoint: \\['empty'\\]"):
        mm.checkpoint.restore(tmp_path / "c", {**state, "empty": jnp.zeros((2, 3))})
    with mm.checkpoint.CheckpointManager(tmp_path / "m") as manager:
        manager.save(1, state)
        manager.wait_until_finished()
        assert manager.restore(target=state)["empty"].shape == (0, 3)


def test_manager_refuses_what_it_would_lose(tmp_path, caplog):
    """Numbered folders that are not checkpoints (pruning deleted them, saves were
    refused), a step older than the latest (silently dropped), a non-integer step
    (invisible after a restart), and in-flight saves counted as complete steps."""
    foreign = tmp_path / "foreign"
    (foreign / "7").mkdir(parents=True)
    (foreign / "7" / "results.csv").write_text("user data")
    with pytest.raises(ValueError, match=r"numbered folders that are not checkpoints \(\['7'\]\)"):
        mm.checkpoint.CheckpointManager(foreign, max_to_keep=1)
    assert (foreign / "7" / "results.csv").exists()
    mm.checkpoint.save(tmp_path / "one", {"w": jnp.ones(2)})  # it said latest_step() None
    with pytest.raises(ValueError, match=r"is one checkpoint \(as mm.checkpoint.save writes\)"):
        mm.checkpoint.CheckpointManager(tmp_path / "one")

    # 0 would delete every step at once / divide by zero inside Orbax's save policy
    with pytest.raises(ValueError, match=r"max_to_keep=0\): give an integer >= 1"):
        mm.checkpoint.CheckpointManager(tmp_path / "z", max_to_keep=0)
    with pytest.raises(ValueError, match=r"save_interval_steps=0\)"):
        mm.checkpoint.CheckpointManager(tmp_path / "z", save_interval_steps=0)
    for empty in (None, {}, [None]):  # Orbax's bare "Found empty item."
        with pytest.raises(ValueError, match="the state has no values"):
            mm.checkpoint.save(tmp_path / "e", empty)
    with mm.checkpoint.CheckpointManager(tmp_path / "e2") as m:
        with pytest.raises(ValueError, match="the state has no values"):
            m.save(1, {})

    d = tmp_path / "ck"
    with mm.checkpoint.CheckpointManager(d) as m:
        for s in (1, 2, 3):
            assert m.save(s, {"w": jnp.full(2, float(s))})
            assert m.latest_step() in (None, *range(1, s + 1))  # in flight: not a step
        m.wait_until_finished()
        assert m.all_steps() == [1, 2, 3] and m.latest_step() == 3
        assert all(type(s) is int for s in m.all_steps())
        with pytest.raises(TypeError, match="must be an int"):
            m.save(4.0, {"w": jnp.zeros(2)})
        with pytest.raises(ValueError, match=r"step 2 is older .* for each of \[3\]"):
            m.save(2, {"w": jnp.zeros(2)})
        assert not m.save(3, {"w": jnp.zeros(2)})  # the same step again: nothing to do
        with pytest.raises(ValueError, match=r"force=True does not replace it: delete it first"):
            m.save(3, {"w": jnp.zeros(2)}, force=True)  # was Orbax's StepAlreadyExistsError
        m.delete(3)
        assert m.save(np.int64(3), {"w": jnp.full(2, 30.0)})
        m.wait_until_finished()
        got = m.restore(target={"w": jnp.zeros(2)})
        with pytest.raises(TypeError, match="must be an int"):  # was "no step 1 ... [1, 3]"
            m.restore("1", target={"w": jnp.zeros(2)})
    np.testing.assert_array_equal(got["w"], [30.0, 30.0])
    with pytest.raises(RuntimeError, match=r"\.save\(9\): the manager is closed"):
        m.save(9, {"w": jnp.zeros(2)})  # was Orbax's "cannot schedule new futures"
    assert m.latest_step() == 3  # reading still works
    # a manager's step folder (what multimesh-run writes) read by restore(): was "lists no
    # arrays ... corrupt"
    with caplog.at_level(logging.WARNING):
        step = mm.checkpoint.restore(d / "1", {"w": jnp.zeros(2)})
    np.testing.assert_array_equal(step["w"], [1.0, 1.0])
    # Orbax's "Metadata file does not exist" (the step's metadata sits beside `default`)
    assert not [r for r in caplog.records if "Metadata file does not exist" in r.getMessage()]
    with pytest.raises(ValueError, match=r"is a CheckpointManager directory \(steps \[1, 2, 3\]\)"):
        mm.checkpoint.restore(d, {"w": jnp.zeros(2)})


def test_container_mismatch_is_not_called_corruption(tmp_path):
    mm.checkpoint.save(tmp_path / "a", [jnp.ones(2), jnp.zeros(2)])
    with pytest.raises(ValueError, match="containers of other kinds"):
        mm.checkpoint.restore(tmp_path / "a", {"0": jnp.ones(2), "1": jnp.zeros(2)})


def test_the_newest_complete_step_while_the_save_that_prunes_it_runs(tmp_path):
    """With max_to_keep=1, Orbax forgets step 1 as soon as the save of step 2 starts;
    until that save completes, step 1 is still the newest complete step on disk (as a new
    manager of the directory finds)."""
    d = tmp_path / "ck"
    with mm.checkpoint.CheckpointManager(d, max_to_keep=1) as m:
        m.save(1, {"w": jnp.full(4, 1.0)})
        m.wait_until_finished()
        m.save(2, {"w": jnp.full(4, 2.0)})
        seen = m.latest_step(), m.all_steps()
        # still in flight after that look: it was in flight during it too
        in_flight = (d / "1").is_dir() and not (d / "2").is_dir()
        m.wait_until_finished()
        assert m.latest_step() == 2 and m.all_steps() == [2]
        got = m.restore(target={"w": jnp.zeros(4)})
    np.testing.assert_array_equal(got["w"], np.full(4, 2.0))
    if in_flight:  # (a fast save may have finished already: nothing to check then)
        assert seen == (1, [1]), seen
    else:
        assert seen[0] in (1, 2), seen


@pytest.mark.parametrize("part", ["d", "manifest.ocdbt"])
def test_a_missing_index_part_is_named(tmp_path, part):
    """A checkpoint whose data folder or manifest was deleted: restore() names what is
    missing (it said only "lists no arrays"; found by a probe)."""
    import shutil

    path = tmp_path / "ck"
    mm.checkpoint.save(path, {"a": jnp.ones(4)})
    gone = path / part
    shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
    with pytest.raises(ValueError, match=rf"lists no arrays \({part} missing or empty in "):
        mm.checkpoint.restore(path, {"a": jnp.zeros(4)})


def test_deleting_a_step_is_one_rename(tmp_path, monkeypatch):
    """Orbax deletes a step in place, file by file in listing order: a process killed
    while it pruned left a numbered folder holding a step's data without its markers,
    which blocked the directory (refused as someone else's folder), or with its item's
    `_METADATA` still there, listed as the latest step and unreadable (found by probes:
    SIGKILL during pruning, and a replay of rmtree stopped at each of its operations).
    The manager now moves a step aside in one rename (a crash leaves it complete, in
    place or aside) and removes it after."""
    d = tmp_path / "ck"
    with monkeypatch.context() as mp:  # what a crash before the removal leaves
        mp.setattr(mm.checkpoint.CheckpointManager, "_purge", lambda self: None)
        with mm.checkpoint.CheckpointManager(d, max_to_keep=1) as m:
            for s in (1, 2, 3):
                m.save(s, {"a": jnp.full(4, float(s))})
            m.wait_until_finished()
            assert m.all_steps() == [3]
            m.delete(3)
            assert m.all_steps() == []
        aside = d / ".deleted-steps"
        assert sorted(os.listdir(aside)) == ["1", "2", "3"]
        assert all((aside / s / "_CHECKPOINT_METADATA").exists() for s in "123")
    with mm.checkpoint.CheckpointManager(d, max_to_keep=1) as m:
        assert not os.listdir(aside) and m.latest_step() is None
        assert m.save(4, {"a": jnp.full(4, 4.0)})
        assert m.save(5, {"a": jnp.full(4, 5.0)})
        m.wait_until_finished()
        assert sorted(os.listdir(d)) == [".deleted-steps", "5"] and not os.listdir(aside)
        np.testing.assert_array_equal(m.restore(target={"a": jnp.zeros(4)})["a"], np.full(4, 5.0))


def test_a_half_deleted_step_is_named(tmp_path):
    """A folder an in-place deletion left (older versions, other tools): refused with
    what it is and what to do; a numbered folder holding anything else is someone
    else's."""
    import shutil

    d = tmp_path / "ck"
    with mm.checkpoint.CheckpointManager(d) as m:
        m.save(1, {"a": jnp.ones(4)})
        m.save(2, {"a": jnp.full(4, 2.0)})
    for root, _dirs, files in os.walk(d / "1"):  # the chunks only
        for f in files:
            if Path(root).name != "d":
                os.remove(Path(root) / f)
    assert any(files for _r, _d, files in os.walk(d / "1"))
    assert mm.checkpoint.saved_steps(d) == [2] and mm.checkpoint.foreign_steps(d) == ["1"]
    with pytest.raises(ValueError, match=r"\['1'\] hold only Orbax data files, as a deletion"):
        mm.checkpoint.CheckpointManager(d)
    shutil.rmtree(d / "1")
    for name, files in (("5", {"default/d/results.csv": "x"}), ("6", {"notes.txt": "x"})):
        for f, text in files.items():
            (d / name / f).parent.mkdir(parents=True, exist_ok=True)
            (d / name / f).write_text(text)
    with pytest.raises(ValueError, match=r"not checkpoints \(\['5', '6'\]\): .* own for checkpoints\.$"):
        mm.checkpoint.CheckpointManager(d)


def test_saving_deleted_arrays_names_them(tmp_path):
    """Arrays a jitted call consumed (donated): JAX's bare "Array has been deleted" from
    inside Orbax, and Orbax's background threads logging tracebacks (found by a probe);
    now a ValueError naming the leaves, before anything is written."""
    w = jnp.ones(4)
    jax.jit(lambda w: w * 2, donate_argnums=0)(w)
    state = {"params": {"w": w, "b": jnp.zeros(2)}}
    with pytest.raises(ValueError, match=r"\['params'\]\['w'\] has been deleted \(donated"):
        mm.checkpoint.save(tmp_path / "a", state)
    assert not (tmp_path / "a").exists()
    with mm.checkpoint.CheckpointManager(tmp_path / "m") as m:
        with pytest.raises(ValueError, match=r"\['params'\]\['w'\] has been deleted"):
            m.save(1, state)
        assert m.save(1, {"params": {"w": jnp.ones(4), "b": jnp.zeros(2)}})
        m.wait_until_finished()
        assert m.all_steps() == [1]


def test_an_older_step_names_a_later_save_still_in_flight(tmp_path):
    """Saving an older step while a later save runs: the message listed the later steps
    to delete as [] (the running save is not a complete step; found by a probe)."""
    with mm.checkpoint.CheckpointManager(tmp_path / "m") as m:
        assert m.save(5, {"w": jnp.ones(1 << 16)})
        with pytest.raises(ValueError, match=r"step 3 is older .* for each of \[5\]"):
            m.save(3, {"w": jnp.ones(4)})
