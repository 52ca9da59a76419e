"""Tests run on 8 virtual CPU devices."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
#: XLA:CPU's LLVM optimizations off for the tests run in this process: their programs are
#: tiny, and compiling is most of their time (the default tier takes ~17% less). Both
#: sides of every comparison (mm.jit and the jax.jit reference) compile alike; the tests
#: that start processes (the CLI, notebooks, the step benchmark's bit-identity check,
#: multi-process, MaxText) run at XLA's defaults. MULTIMESH_TEST_XLA_OPT=1 keeps XLA's
#: defaults here too.
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
if os.environ.get("MULTIMESH_TEST_XLA_OPT", "0") == "0" and (
    "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]
):
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE_FLAG

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
assert len(jax.devices()) == 8  # start the backend now: no test may change the device count

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import multimesh as mm  # noqa: E402


def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto`` (pyproject's addopts): the default tier (addopts' ``-m``)
    on up to 4 (one per core); the tiers chosen with another ``-m`` (multi-process,
    containers, MaxText, slow) one test at a time, since each of their tests starts
    several processes itself."""
    addopts = config.getini("addopts")
    default = addopts[addopts.index("-m") + 1] if "-m" in addopts else ""
    if (config.option.markexpr or "") != default:
        return 0
    return max(1, min(4, os.cpu_count() or 1))


#: modules holding the longest tests (whole models, notebooks, the CLI, several
#: processes): collected first, so that on few workers the run does not end on one of
#: them while the other workers are idle
_LONG_FIRST = (
    "test_gpt.py",
    "test_run.py",
    "test_remat.py",
    "test_notebooks.py",
    "test_multiprocess.py",
    "test_transfers.py",
    "test_layers.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        return _LONG_FIRST.index(name) if name in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=rank)  # stable: the order within each module is kept


@pytest.fixture(autouse=True)
def _fresh_shared_executables():
    """Each test starts without executables other tests' ``mm.jit`` objects made (they
    are shared process-wide, ``runtime.compiling.SHARED``): its compile counts are its
    own. Tests comparing two ways of compiling turn sharing off themselves."""
    from multimesh.runtime import compiling

    compiling.SHARED.cache_clear()
    yield


def to_np(tree):
    def conv(a):
        if hasattr(a, "dtype") and jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):
            a = jax.random.key_data(a)
        return np.asarray(a)

    return jax.tree.map(conv, tree)


def assert_close(got, want, rtol=1e-5, atol=1e-6):
    g, w = to_np(got), to_np(want)
    assert jax.tree.structure(g) == jax.tree.structure(w)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def mlp_loss(ws, x, y):
    """Residual tanh layers, layer ``i`` as task ``s<i>`` on stage ``i``; mean squared
    error against ``y``."""
    h = x
    for i, w in enumerate(ws):
        with mm.task(f"s{i}", stage=i):
            h = h + jnp.tanh(h @ w)
    return jnp.mean((h - y) ** 2)


def reference(fn, mmesh, *args, **kwargs):
    """The same function under plain jax.jit on the global mesh (tasks transparent)."""
    with mmesh:
        return jax.jit(fn)(*args, **kwargs)


def stage_of(x, mmesh):
    """Which submesh an array lives on (or None)."""
    ids = {d.id for d in x.sharding.device_set}
    for i in range(mmesh.num_stages):
        if ids == {d.id for d in mmesh.submesh(i).devices.flat}:
            return i
    return None


@pytest.fixture
def mesh222():
    return mm.make_mesh((2, 2, 2), ("stage", "data", "model"))


@pytest.fixture
def mesh8():
    return mm.make_mesh((8,), ("stage",))


@pytest.fixture
def mesh4x2():
    return mm.make_mesh((4, 2), ("stage", "data"))
