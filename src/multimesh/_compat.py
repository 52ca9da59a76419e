"""The one place that touches JAX internals (``jax._src``) or version differences.

Everything else in MultiMesh uses public JAX APIs (``jax``, ``jax.extend``,
``jax.sharding``) and imports what it needs from here.  Supported: jax 0.10.x
(Python 3.11) and jax 0.12.x (Python 3.12).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend  # noqa: F401  (jax 0.10 does not import it eagerly)
import numpy as np
from jax._src import api_util as _api_util
from jax._src import config as _cfg
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import mesh as _mesh_lib
from jax._src import source_info_util as _siu
from jax._src import traceback_util as _traceback_util
from jax._src.lib import xla_client as _xc
from jax.extend import core as jcore

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

Var = jcore.Var
Literal = jcore.Literal
Jaxpr = jcore.Jaxpr
ClosedJaxpr = jcore.ClosedJaxpr
JaxprEqn = jcore.JaxprEqn
DropVar = jcore.DropVar
jaxpr_as_fun = jcore.jaxpr_as_fun


def stable_hash(text: str) -> int:
    """A hash of ``text`` that is the same in every process (``hash`` is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def register_exclusion(path: str) -> None:
    """Hide MultiMesh frames from user tracebacks (like JAX and Equinox do)."""
    _traceback_util.register_exclusion(path)


register_exclusion(__file__)


def api_boundary(fun: Callable[..., Any]) -> Callable[..., Any]:
    """Filter MultiMesh's (and JAX's) frames from tracebacks raised through ``fun``."""
    return _traceback_util.api_boundary(fun)


def register_cache(cache: Any, what: str) -> None:
    """Let ``jax.clear_caches()`` clear ``cache`` (its ``cache_clear()``)."""
    from jax._src import util as _util

    _util.register_cache(cache, what)


# --- jax.config switches jax.jit honours ---------------------------------------------------

InternalFloatingPointError = _api_util.InternalFloatingPointError


def jit_disabled() -> bool:
    """``jax.disable_jit()`` is on: jitted functions run as plain Python."""
    return bool(_cfg.disable_jit.value)


def checks_special() -> bool:
    """``jax_debug_nans`` or ``jax_debug_infs`` is on."""
    return bool(_cfg.debug_nans.value or _cfg.debug_infs.value)


@contextlib.contextmanager
def special_checks_off() -> Iterator[None]:
    """No NaN/Inf checks inside: ``jax.jit`` checks a program's outputs, not the values
    between its parts (our fragments)."""
    with jax.debug_nans(False), jax.debug_infs(False):
        yield


def check_special(name: str, arrays: Sequence[Any]) -> None:
    """Raise ``InternalFloatingPointError`` for a NaN/Inf in ``arrays`` (this process's
    shards), as ``jax.jit`` checks its outputs under ``jax_debug_nans``."""
    bufs = [sh.data for a in arrays if isinstance(a, jax.Array) for sh in a.addressable_shards]
    _dispatch.check_special(name, bufs)


# --- single-device shardings (jax 0.12 deprecates the class's public name) ----------------

from jax._src.sharding_impls import SingleDeviceSharding as _SingleDeviceSharding  # noqa: E402


def single_device_sharding(device: Any) -> Any:
    """A sharding placing a whole array on ``device``."""
    return _SingleDeviceSharding(device)


def is_single_device_sharding(sh: Any) -> bool:
    """Whether ``sh`` is a ``SingleDeviceSharding`` (without the deprecated name)."""
    return isinstance(sh, _SingleDeviceSharding)


# --- name stacks -------------------------------------------------------------------------


def scope_names(name_stack: Any) -> list[str]:
    """The named scopes of a name stack, outermost first (transforms skipped)."""
    return [e.name for e in name_stack.stack if isinstance(e, _siu.Scope)]


def is_transposed(name_stack: Any) -> bool:
    """Whether the name stack records a ``transpose`` (i.e. a backward-pass equation)."""
    return any(isinstance(e, _siu.Transform) and e.name == "transpose" for e in name_stack.stack)


def concat_name_stacks(outer: Any, inner: Any) -> Any:
    return outer + inner


def push_scope(name_stack: Any, scope: str) -> Any:
    """The name stack with one more named scope inside."""
    return name_stack.extend(scope)


def drop_scopes(name_stack: Any, names: Callable[[str], bool]) -> Any:
    """The name stack without the named scopes for which ``names`` is true."""
    keep = tuple(e for e in name_stack.stack if not (isinstance(e, _siu.Scope) and names(e.name)))
    return dataclasses.replace(name_stack, stack=keep)


def with_name_stack(eqn: JaxprEqn, name_stack: Any) -> JaxprEqn:
    return eqn.replace(source_info=eqn.source_info.replace(name_stack=name_stack))


def has_ordered_effects(eqn: Any) -> bool:
    """Whether an equation has effects JAX orders (``ordered=True`` callbacks, prints)."""
    from jax._src import effects as _effects

    return bool(eqn.effects) and any(_effects.ordered_effects.contains(e) for e in eqn.effects)


# --- mesh contexts -----------------------------------------------------------------------


def empty_abstract_mesh() -> jax.sharding.AbstractMesh:
    return _mesh_lib.empty_abstract_mesh


@contextlib.contextmanager
def no_mesh_context() -> Iterator[None]:
    """Clear any concrete and abstract mesh context while MultiMesh traces a program."""
    dev_cfg, abs_cfg, empty_dev = _mesh_configs()
    prev_dev = dev_cfg.swap_local(empty_dev)
    prev_abs = abs_cfg.swap_local(_mesh_lib.empty_abstract_mesh)
    try:
        yield
    finally:
        abs_cfg.set_local(prev_abs)
        dev_cfg.set_local(prev_dev)


def _mesh_configs() -> tuple[Any, Any, Any]:
    if hasattr(_mesh_lib, "device_context"):  # jax >= 0.11
        return (
            _mesh_lib.device_context,
            _mesh_lib.abstract_mesh_context_manager,
            _mesh_lib.empty_concrete_mesh,
        )
    from jax._src import config as _cfg

    return _cfg.device_context, _cfg.abstract_mesh_context_manager, None


def manual_axes() -> tuple[str, ...]:
    """The mesh axes in manual mode here (inside a ``shard_map`` body), else ``()``."""
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)


@contextlib.contextmanager
def use_abstract_mesh(mesh: jax.sharding.AbstractMesh) -> Iterator[None]:
    """Set the abstract mesh while tracing, even if its size differs from the current
    one (``jax.sharding.use_abstract_mesh`` refuses that; MultiMesh traces tasks for
    submeshes of different sizes inside one program and lowers each part separately)."""
    _, abs_cfg, _ = _mesh_configs()
    prev = abs_cfg.swap_local(mesh)
    try:
        yield
    finally:
        abs_cfg.set_local(prev)


@contextlib.contextmanager
def mesh_context(mesh: jax.sharding.Mesh) -> Iterator[None]:
    """``jax.set_mesh(mesh)``'s context, also while tracing (which ``set_mesh`` refuses):
    ``mm.jit`` under ``jax.disable_jit()`` and ``jax.grad`` runs the function there."""
    dev_cfg, abs_cfg, _ = _mesh_configs()
    prev_abs = abs_cfg.swap_local(mesh.abstract_mesh)
    prev_dev = dev_cfg.swap_local(mesh)
    try:
        yield
    finally:
        dev_cfg.set_local(prev_dev)
        abs_cfg.set_local(prev_abs)


def set_mesh(mesh: jax.sharding.Mesh) -> Any:
    """Context manager making ``mesh`` the current JAX mesh (concrete and abstract)."""
    return jax.set_mesh(mesh)


# --- transfers ---------------------------------------------------------------------------

_COPY = _xc.ArrayCopySemantics.ALWAYS_COPY


def same_layout_copy(
    xs: Sequence[jax.Array], shardings: Sequence[jax.sharding.Sharding]
) -> list[jax.Array]:
    """Copy arrays shard-by-shard to ``shardings`` of the same layout on other devices.

    This is what ``jax.device_put`` ends in for equal layouts, without its Python
    dispatch (~18 µs instead of ~150 µs per array). Callers guarantee the layouts match.
    """
    return same_layout_copier(shardings)(xs)


def same_layout_copier(
    shardings: Sequence[jax.sharding.Sharding],
) -> Callable[[Sequence[jax.Array]], list[jax.Array]]:
    """``same_layout_copy`` to fixed ``shardings``, its argument lists built once."""
    devs = [s._internal_device_list.addressable_device_list for s in shardings]  # type: ignore[attr-defined]
    shs = list(shardings)
    sem = [_COPY] * len(shs)
    batched = _xc.batched_copy_array_to_devices_with_sharding

    def copy(xs: Sequence[jax.Array]) -> list[jax.Array]:
        return batched(xs, devs, shs, sem)

    return copy


def fast_call(compiled: Any) -> Callable[..., Any]:
    """The C++ entry of a ``jax.stages.Compiled`` (skips one Python frame per call)."""
    try:
        call = compiled._call or compiled._executable.create_cpp_call(compiled._params)
    except AttributeError:  # a different jax: the public call
        return compiled
    if call is None:
        return compiled
    compiled._call = call
    return call


def transfers_guarded() -> bool:
    """Whether the caller disallows device-to-device transfers (``jax.transfer_guard``)."""
    v = _cfg.transfer_guard_device_to_device.value
    return v is not None and "disallow" in str(v)


def host_transfers_disallowed() -> bool:
    """Whether the caller refuses implicit host-to-device transfers (``jax.jit`` then
    refuses host arguments: NumPy arrays, Python scalars)."""
    v = _cfg.transfer_guard_host_to_device.value
    return v is not None and "disallow" in str(v)


def own_transfers_allowed() -> contextlib.AbstractContextManager[None]:
    """Device-to-device transfers allowed (the runtime's moves between submeshes)."""
    return jax.transfer_guard_device_to_device("allow")


@functools.cache
def sub_byte_inputs_work() -> bool:
    """Whether a compiled program takes a sub-byte array (int4) as input. jax 0.10's
    ahead-of-time ``Compiled`` refuses them (it compares the array's layout, 0 bits per
    element, with the program's, 4: "input layouts that disagree"), even its own
    outputs; plain ``jax.jit`` calls skip that check. Probed once, on a tiny program."""
    import jax.numpy as jnp

    sh = single_device_sharding(jax.devices()[0])
    try:
        c = jax.jit(lambda a: a).lower(jax.ShapeDtypeStruct((2,), jnp.int4, sharding=sh))
        c.compile()(jax.device_put(np.zeros(2, jnp.int4), sh)).block_until_ready()
    except ValueError:
        return False
    return True


def persistent_cache_on() -> bool:
    """Whether JAX's persistent compilation cache is in use (a cache directory is set).

    Executables it loads are deserialized ones, which XLA:CPU cannot serialize again
    whole (a relocated copy fails at run time with "Function ... not found"); with the
    cache on, every fragment compiles (or loads) through it instead. JAX decides once
    per process, at its first compile, and keeps reading the cache after the settings
    turn it off: that decision counts too."""
    if bool(jax.config.jax_compilation_cache_dir) and bool(jax.config.jax_enable_compilation_cache):
        return True
    from jax._src import compilation_cache as _cc

    # a cache JAX opened and decided to use (``_cache_used`` alone is only the
    # enabling setting's value at that time: True by default, with no cache)
    return getattr(_cc, "_cache", None) is not None and bool(getattr(_cc, "_cache_used", False))


def relocate_compiled(compiled: Any, mapping: dict[int, Any]) -> Any:
    """``compiled`` loaded for other devices, without compiling again.

    Device ``d`` of ``compiled`` becomes ``mapping[d.id]`` (same process, same platform).
    XLA's code does not depend on which devices run it, only on their logical
    positions, so the serialized executable is loaded with a new device assignment, as
    JAX's own compilation cache does across device assignments on GPU. Raises
    ``ValueError`` for what cannot move: host callbacks, effects, constants, devices
    missing from ``mapping``.
    """
    import io

    from jax._src import compiler as _compiler
    from jax.experimental import serialize_executable as _se

    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if unloaded is None:
        raise ValueError("this executable does not support serialization")
    if (
        unloaded.host_callbacks
        or unloaded.keepalive
        or unloaded.ordered_effects
        or unloaded.unordered_effects
    ):
        raise ValueError("executables with host callbacks or effects are not relocated")
    src = list(unloaded.device_list)
    try:
        dst = [mapping[d.id] for d in src]
    except KeyError:
        raise ValueError("the executable uses devices outside the mapping") from None
    backend = dst[0].client
    options = _compiler.get_compile_options(
        num_replicas=1,
        num_partitions=len(dst),
        device_assignment=np.array([[d.id for d in dst]]),
        backend=backend,
    )
    device_list = _xc.DeviceList(tuple(dst))

    class _Unpickler(_se._JaxPjrtUnpickler):
        def persistent_load(self, pid: Any) -> Any:
            if pid[0] == "exec":
                return backend.deserialize_executable(pid[1], device_list, options)
            if pid[0] == "device":
                if pid[1] not in mapping:
                    raise ValueError("the executable refers to a device outside the mapping")
                return mapping[pid[1]]
            return super().persistent_load(pid)

    try:
        data, in_tree, out_tree = _se.serialize(compiled)
        loaded = _Unpickler(io.BytesIO(data), backend, dst).load()
        if len(loaded) == 3:  # jax < 0.12.1
            (moved, args_info_flat, no_kwargs), const_args = loaded, []
        else:  # (version, executable, args info, no_kwargs, constants)
            _version, moved, args_info_flat, no_kwargs, const_args = loaded[:5]
        exe = moved.load()
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - what XLA cannot move is compiled instead
        # (XLA:CPU cannot serialize a sort that has run: "`LessThan` is not serializable")
        raise ValueError(f"this executable cannot be moved to other devices ({e})") from e
    return jax.stages.Compiled(
        exe,
        list(const_args),
        in_tree.unflatten(args_info_flat),
        out_tree,
        no_kwargs=no_kwargs,
    )


def make_jaxpr_obj(
    invars: list[Any], outvars: list[Any], eqns: list[Any], name: str = "fragment"
) -> Any:
    """A (const-free) ``Jaxpr`` from parts; effects are the union of the equations'."""
    effects: set[Any] = set()
    for e in eqns:
        effects |= set(e.effects)
    dbg = jcore.DebugInfo(
        "mm.jit",
        name,
        tuple(f"in{i}" for i in range(len(invars))),
        tuple(f"out{i}" for i in range(len(outvars))),
    )
    return jcore.Jaxpr([], invars, outvars, eqns, frozenset(effects), dbg)


_AVAL_TOKENS: dict[Any, str] = {}


def _aval_token(aval: Any) -> str:
    """A short text of ``aval`` (shape, dtype, weak type, sharded axes), cached."""
    try:
        return _AVAL_TOKENS[aval]
    except (KeyError, TypeError):
        pass
    short = getattr(aval, "str_short", None)
    text = short() if short is not None else repr(aval)
    if getattr(aval, "weak_type", False):
        text += "~w"
    text = f"{type(aval).__name__}:{text}"
    try:
        if len(_AVAL_TOKENS) > 65536:
            _AVAL_TOKENS.clear()
        _AVAL_TOKENS[aval] = text
    except TypeError:  # unhashable
        pass
    return text


def _device_ids(v: Any) -> tuple[Any, ...]:
    if isinstance(v, jax.Device):
        return (v.id,)
    if isinstance(v, jax.sharding.Mesh):  # the empty mesh holds None
        return tuple(getattr(d, "id", None) for d in v.devices.flat)
    if isinstance(v, jax.sharding.NamedSharding):
        return _device_ids(v.mesh) if isinstance(v.mesh, jax.sharding.Mesh) else ()
    return tuple(sorted(d.id for d in v.device_set))


#: parameters of custom-derivative calls that only differentiation reads (lowering runs
#: ``call_jaxpr``): a new object per trace, so they do not key the compiled program
_AD_ONLY = frozenset({"jvp_jaxpr_fun", "jvp_jaxpr_thunk", "fwd_jaxpr_thunk", "bwd", "out_trees"})
#: other parameters lowering does not read, by primitive: a remat's policy (read by
#: differentiation, done before a fragment is compiled; often a new object per layer)
#: and a reduce's Python reducer (lowered from its ``jaxpr`` parameter)
_NOT_LOWERED = {"remat2": frozenset({"policy"}), "reduce": frozenset({"computation"})}


_DTYPE_TEXT: dict[Any, str] = {}  # NumPy dtypes' names (``str(dtype)`` is slow)


def _dtype_text(dtype: Any) -> str:
    text = _DTYPE_TEXT.get(dtype)
    if text is None:
        text = _DTYPE_TEXT[dtype] = str(dtype)
    return text


def _value_token(v: Any, portable: bool = False) -> Any:
    """An array or scalar by its bytes (its text elides large arrays, and every NaN
    prints as ``nan``). ``portable``: a ``jax.Array`` by its type only (a process may
    not hold its bytes)."""
    if type(v) is np.ndarray or isinstance(v, np.generic):  # literals: the common case
        a = v
    elif portable and isinstance(v, jax.Array):
        return ("jax array", v.shape, str(v.dtype))
    else:
        dtype = getattr(v, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            return ("keys", str(dtype), _value_token(jax.random.key_data(v)))
        if isinstance(v, jax.Array) and not v.is_fully_addressable:
            # other processes hold part of it: by identity (kept alive by its jaxpr)
            return ("global array", v.shape, str(v.dtype), str(v.sharding), id(v))
        a = np.asarray(v)
    data = a.tobytes()
    if len(data) > 64:
        data = hashlib.blake2b(data, digest_size=16).digest()
    return ("array", a.shape, _dtype_text(a.dtype), data)


def _param_token(v: Any, memo: dict[Any, Any]) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if v == v else _value_token(v)  # NaNs by their bits
    if isinstance(v, (jax.sharding.Sharding, jax.sharding.Mesh, jax.Device)):
        # by text (and devices when asked), never by identity below: a Mesh is
        # callable, and a nested jit's ctx_mesh is each stage's own submesh object
        text = _portable_text(str(v)) if memo.get("portable") else str(v)
        if memo["devices"]:
            return (type(v).__name__, text, _device_ids(v))
        return (type(v).__name__, text)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, *(_param_token(x, memo) for x in v))
    if isinstance(v, (set, frozenset)):  # sorted: a set's order varies between processes
        return (type(v).__name__, *sorted(map(repr, (_param_token(x, memo) for x in v))))
    if isinstance(v, ClosedJaxpr):
        consts = tuple(_param_token(c, memo) for c in v.consts)
        return ("closed", _jaxpr_token(v.jaxpr, memo), consts)
    if isinstance(v, Jaxpr):
        return _jaxpr_token(v, memo)
    if isinstance(v, dict):
        return ("dict", *sorted((str(k), _param_token(x, memo)) for k, x in v.items()))
    if isinstance(v, (np.ndarray, np.generic, jax.Array)):
        return _value_token(v, memo.get("portable", False))
    if callable(v) and not isinstance(v, type):
        if memo.get("portable"):  # the same in every process: by its name
            name = getattr(v, "__qualname__", type(v).__qualname__)
            return ("callable", type(v).__name__, getattr(v, "__module__", ""), name)
        # a Python callback: by identity (its text may hide its state). The traced
        # program that holds it is kept as long as executables keyed by it are.
        return ("callable", type(v).__name__, id(v))
    text = str(v)
    if memo.get("portable"):
        text = _portable_text(text)
    return (type(v).__name__, text)


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")  # an object's address in its text
_BRACES = re.compile(r"\{([^{}]*)\}")  # a set's items (printed in hash order)


def _portable_text(text: str) -> str:
    """``text`` as every process prints it: no object addresses, the items of each
    ``{...}`` sorted (a set of axis names prints in each process's hash order)."""
    text = _ADDRESS.sub("0x", text)
    return _BRACES.sub(lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", text)


def _jaxpr_token(jaxpr: Any, memo: dict[Any, Any]) -> Any:
    hit = memo.get(id(jaxpr))
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    ids: dict[Any, int] = {}
    contexts: dict[int, str] = memo.setdefault("contexts", {})
    portable = memo.get("portable", False)

    def bind(v: Any) -> str:
        ids[v] = len(ids)
        return _aval_token(v.aval)

    def ref(v: Any) -> Any:
        if isinstance(v, Literal):
            return ("lit", _value_token(v.val, portable), _aval_token(v.aval))
        k = ids.get(v)
        if k is None:  # free variable
            return ("free", bind(v))
        return k

    def context(e: Any) -> str | None:
        # the equation's context (threefry_partitionable, compute_type, XLA metadata)
        # changes its lowering; contexts are interned: one text each
        c = getattr(e, "ctx", None)
        if c is None:
            return None
        text = contexts.get(id(c))
        if text is None:
            text = repr(c)
            if memo.get("portable"):
                text = _portable_text(text)
            contexts[id(c)] = text
            memo.setdefault("keep", []).append(c)
        return text

    head = (
        tuple(bind(v) for v in jaxpr.constvars),
        tuple(bind(v) for v in jaxpr.invars),
    )
    eqns = []
    for e in jaxpr.eqns:
        ins = tuple(ref(v) for v in e.invars)
        name = e.primitive.name
        unread = _AD_ONLY if name.startswith("custom_") else _NOT_LOWERED.get(name, ())
        params = tuple(
            sorted(
                (k, "not lowered" if k in unread else _param_token(x, memo))
                for k, x in e.params.items()
            )
        )
        outs = tuple(
            ("drop", _aval_token(v.aval)) if isinstance(v, DropVar) else bind(v) for v in e.outvars
        )
        eqns.append((e.primitive.name, ins, params, outs, context(e)))
    token = (head, tuple(eqns), tuple(ref(v) for v in jaxpr.outvars))
    memo[id(jaxpr)] = (jaxpr, token)
    return token


def jaxpr_fingerprint(jaxpr: Any, devices: bool = False, portable: bool = False) -> str:
    """A digest of ``jaxpr``'s structure: equal for jaxprs that differ only in their
    variables' identities (the same work for another microbatch), different when any
    primitive, parameter, literal, shape, dtype or weak type differs. Parameters other
    than numbers, text and jaxprs count by their text (as the jaxpr's printed form shows
    them: a sharding's devices are not in it, see ``embedded_placements``) and, with
    ``devices``, by the devices they name too. ``portable``: the same in every process
    (Python callbacks by name, not identity; no object addresses). Much faster than
    ``str(jaxpr)``."""
    token = _jaxpr_token(jaxpr, {"devices": devices, "portable": portable})
    return hashlib.blake2b(repr(token).encode(), digest_size=16).hexdigest()


def single_device_arrays(x: jax.Array) -> list[jax.Array]:
    """The per-device pieces of an array, in its sharding's addressable device order."""
    return [s.data for s in x.addressable_shards]


try:  # the concrete jax.Array class (a C++ type): an exact type check is cheap
    from jax._src.array import ArrayImpl as ARRAY_TYPE
except ImportError:  # pragma: no cover - another jax: no fast path
    ARRAY_TYPE = type(None)


def with_weak_type(x: jax.Array, weak: bool) -> jax.Array:
    """``x`` typed weakly or strongly as ``weak`` says, on the same buffers (no copy):
    arrays assembled from pieces, or an argument passed through, carry the type the
    program gave its output (as ``jax.jit``'s outputs do)."""
    if type(x) is not ARRAY_TYPE or x.weak_type == weak:  # PRNG keys are never weak
        return x
    return ARRAY_TYPE(
        x.aval.update(weak_type=weak),
        x.sharding,
        x._arrays,  # type: ignore[attr-defined]
        committed=x.committed,  # type: ignore[attr-defined]
        _skip_checks=True,
    )


def rewrap(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x``'s buffers as a committed array with ``sharding``, no copy: what
    ``jax.make_array_from_single_device_arrays(x.shape, sharding, pieces)`` gives (a
    strong type), without its checks (~50 us). Only for a ``sharding`` that
    :func:`same_layout_as` accepted for ``x``."""
    if type(x) is not ARRAY_TYPE:  # PRNG keys and other array types: the checked path
        return jax.make_array_from_single_device_arrays(x.shape, sharding, single_device_arrays(x))
    return ARRAY_TYPE(
        _rewrap_aval(x.shape, x.dtype, sharding),
        sharding,
        x._arrays,  # type: ignore[attr-defined]
        committed=True,
        _skip_checks=True,
    )


@functools.lru_cache(maxsize=4096)
def _rewrap_aval(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Any:
    """The type ``make_array_from_single_device_arrays`` gives such an array."""
    return _core.update_aval_with_sharding(
        _core.ShapedArray(shape, dtype, weak_type=False), sharding
    )


def buffer_pointers(x: jax.Array) -> set[int]:
    """The addresses of ``x``'s local buffers (two arrays sharing one alias it)."""
    if type(x) is not ARRAY_TYPE:
        return set()
    try:
        return {a.unsafe_buffer_pointer() for a in x._arrays}  # type: ignore[attr-defined]
    except Exception:  # deleted, or a backend without pointers
        return set()


def same_layout_as(x: jax.Array, sharding: jax.sharding.Sharding) -> bool:
    """Whether ``x``'s buffers, in order, are ``sharding``'s layout of ``x`` (so an array
    of them with that sharding needs no copy): same devices in the same order, equivalent
    layout, all addressable here."""
    try:
        have = x.sharding
        return (
            isinstance(x, jax.Array)
            and not isinstance(x, jax.core.Tracer)
            and have.is_fully_addressable
            and sharding.is_fully_addressable
            and device_assignment_ids(have) == device_assignment_ids(sharding)
            and addressable_device_ids(have) == addressable_device_ids(sharding)
            and have.is_equivalent_to(sharding, x.ndim)
        )
    except (AttributeError, TypeError, ValueError):
        return False


def arg_info(aval: Any, donated: bool) -> Any:
    """``jax.stages.ArgInfo`` for one argument."""
    return jax.stages.ArgInfo(aval, donated)


def device_assignment_ids(sharding: jax.sharding.Sharding) -> tuple[int, ...]:
    """Every device id of ``sharding`` in its device-assignment order (jitted programs
    take arguments of one order only)."""
    return tuple(int(d.id) for d in sharding._device_assignment)  # type: ignore[attr-defined]


def same_layout_any_devices(a: jax.sharding.Sharding, b: jax.sharding.Sharding, ndim: int) -> bool:
    """Whether two shardings split an array of rank ``ndim`` the same way, whatever
    devices they use (what ``jax.jit`` compares a committed argument with its
    ``in_shardings`` by; it moves an argument that differs only in devices)."""
    ha, hb = a._to_xla_hlo_sharding(ndim), b._to_xla_hlo_sharding(ndim)  # type: ignore[attr-defined]
    try:
        from jax._src.op_shardings import are_hlo_shardings_equal
    except ImportError:
        return bool(ha == hb)
    return bool(are_hlo_shardings_equal(ha, hb))


def addressable_device_ids(sharding: jax.sharding.Sharding) -> list[int]:
    """Device ids in the order :func:`single_device_arrays` returns an array's pieces."""
    return [int(d.id) for d in sharding._addressable_device_assignment]  # type: ignore[attr-defined]


def fresh_copy(xs: Sequence[jax.Array]) -> list[jax.Array]:
    """New buffers with the same contents, shardings and weak types (a float0 value, a
    host array JAX makes for an integer's gradient, holds no data: kept)."""
    out = list(xs)
    plain = [
        k
        for k, x in enumerate(xs)
        if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
    ]
    if plain:
        for k, c in zip(
            plain, same_layout_copy([xs[k] for k in plain], [xs[k].sharding for k in plain])
        ):
            out[k] = c
    for k, x in enumerate(xs):
        if out[k] is x and isinstance(x, jax.Array):  # PRNG keys: no shard-wise copy
            out[k] = jax.device_put(x, x.sharding, may_alias=False)
    return out


def key_impl(dtype: Any) -> Any:
    """The PRNG implementation of a typed key dtype (for ``jax.random.wrap_key_data``)."""
    return dtype._impl  # noqa: SLF001


def default_format(sharding: jax.sharding.Sharding) -> Any:
    """``jax.experimental.layout.Format`` with the default layout and ``sharding``."""
    from jax.experimental.layout import Format

    return Format(None, sharding)


def trace_context() -> Any:
    """The JAX settings a trace depends on (``jax_enable_x64``, dtype promotion,
    ``threefry_partitionable``, ...): part of ``jax.jit``'s cache key, and of ours."""
    from jax._src import config as _config

    return _config.trace_context()


def check_no_escaped_tracers(consts: Any) -> None:
    """Raise JAX's ``UnexpectedTracerError`` (as ``jax.jit`` does) for a value traced
    elsewhere that a traced function captured: a tracer leaked from an earlier trace
    (stored in a global) becomes a constant of ``jax.make_jaxpr``'s jaxpr."""
    for c in consts:
        if isinstance(c, _core.Tracer):
            raise _core.escaped_tracer_error(
                c, "It was captured by a function mm.jit traced (a closed-over value)."
            )


def traces_of_their_own() -> contextlib.AbstractContextManager[Any]:
    """A context in which nested ``jax.jit`` functions are traced anew, not taken from
    JAX's trace cache of calls outside ``mm.jit`` (nor give theirs to them): the same
    code traces differently there (``mm.microbatch`` unrolls its loop under ``mm.jit``
    and is a ``lax.scan`` outside it), but JAX keys its cache only by its own settings.
    So one of those settings changes while ``mm.jit`` traces, in a way that changes
    nothing else: the regex removed from source file names in HLO metadata (part of
    JAX's trace context, read only when lowering) gets an alternative that never
    matches."""
    state = _cfg.hlo_source_file_canonicalization_regex
    cur = state.value
    return state("(?!)@mm" if cur is None else f"(?:{cur})|(?!)@mm")


def checkify_error_type() -> type | None:
    """``checkify.Error``, once the program has imported checkify (else ``None``: no
    output can be one, and checkify is not imported for nothing)."""
    import sys

    mod = sys.modules.get("jax._src.checkify")
    return getattr(mod, "Error", None) if mod is not None else None


def config_key() -> Any:
    """The JAX settings a program is traced and lowered under (x64, matmul precision,
    the mesh context, ...), hashable: what ``jax.jit`` adds to its cache keys."""
    from jax._src import config as _config

    return _config.trace_context()


def caller_config() -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Wrap jobs for another thread so that they see this thread's JAX settings.

    ``jax.enable_x64(True)``, ``jax.default_matmul_precision(...)`` and the other
    configuration context managers set thread-local values: a compile thread would lower
    with the global ones (x64 off: a dtype mismatch; another matmul precision: silently
    other numbers). The thread-local values are read once, here, on the calling thread."""
    from jax._src import config as _config

    states = [h for h in _config.config._value_holders.values() if isinstance(h, _config.State)]
    local = [(s, s.get_local()) for s in states]

    def wrap(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            old = [(s, s.swap_local(v)) for s, v in local]
            try:
                return fn()
            finally:
                for s, v in reversed(old):
                    s.set_local(v)

        return run

    return wrap


def eqn_context_mesh(eqn: Any) -> Any:
    """The abstract mesh an equation was traced under (``eqn.ctx``), or ``None``."""
    ctx = getattr(eqn, "ctx", None)
    if ctx is not None and not hasattr(ctx, "cur_abstract_mesh"):
        # jax >= 0.12.1: the context is a tuple of settings
        i = _ctx_mesh_index()
        return None if i is None else ctx.configs[i]
    return getattr(ctx, "cur_abstract_mesh", None)


def _ctx_mesh_index() -> int | None:
    """Where the abstract mesh is in an equation context's settings (jax >= 0.12.1)."""
    names = tuple(getattr(_cfg, "jaxpr_eqn_ctx_names", tuple)())
    return (
        names.index("abstract_mesh_context_manager")
        if ("abstract_mesh_context_manager" in names)
        else None
    )


# JaxprEqnContext._create's parameters, by JAX version (it is a C interner: no signature)
_CTX_FIELDS_010 = [
    "compute_type",
    "threefry_partitionable",
    "cur_abstract_mesh",
    "remove_size_one_mesh_axis",
    "xla_metadata",
]
_CTX_FIELDS_012 = [
    "compute_type",
    "threefry_partitionable",
    "cur_abstract_mesh",
    "cur_layout_mode",
    "remove_size_one_mesh_axis",
    "no_collectives",
    "xla_metadata",
]


def with_context_mesh(eqn: Any, mesh: Any) -> Any:
    """The equation with its traced-under abstract mesh replaced (JAX re-enters it when
    it evaluates the equation). Contexts are interned by JAX: build a new one, never
    mutate."""
    ctx = eqn.ctx
    if not hasattr(ctx, "cur_abstract_mesh"):  # jax >= 0.12.1: a tuple of settings
        i = _ctx_mesh_index()
        if i is None or ctx.configs[i] is mesh or ctx.configs[i] == mesh:
            return eqn
        configs = ctx.configs[:i] + (mesh,) + ctx.configs[i + 1 :]
        md = ctx.xla_metadata
        md = None if md is None else tuple(sorted(md.items()))
        return eqn.replace(ctx=_core.JaxprEqnContext._create(md, configs))
    fields = _CTX_FIELDS_012 if hasattr(ctx, "cur_layout_mode") else _CTX_FIELDS_010
    if ctx.cur_abstract_mesh is mesh or ctx.cur_abstract_mesh == mesh:
        return eqn
    args = []
    for name in fields:
        if name == "cur_abstract_mesh":
            args.append(mesh)
        elif name == "xla_metadata":
            md = ctx.xla_metadata
            args.append(None if md is None else tuple(sorted(md.items())))
        else:
            args.append(getattr(ctx, name))
    return eqn.replace(ctx=_core.JaxprEqnContext._create(*args))


def psum_over_replicas(jaxpr: Any, axis: str, size: int) -> Any:
    """``jaxpr`` (a ``shard_map`` body) with each ``psum`` over ``axis`` -- an axis the
    values are replicated over, that the body no longer runs on -- made a psum over its
    other axes times ``size`` (what summing ``size`` equal replicas gives). JAX's
    transpose of ``shard_map(check_vma=False)`` adds such psums over every mesh axis
    left out of the specs."""
    from jax._src.lax import lax as _lax

    eqns = []
    changed = False
    for e in jaxpr.eqns:
        axes = e.params.get("axes") if e.primitive.name == "psum" else None
        if not axes or axis not in axes:
            eqns.append(e)
            continue
        changed = True
        rest = tuple(a for a in axes if a != axis)
        ins = list(e.invars)
        if rest:
            summed = [Var(v.aval) for v in e.outvars]
            eqns.append(e.replace(params={**e.params, "axes": rest}, outvars=summed))
            ins = summed
        for x, out in zip(ins, e.outvars):
            aval = x.aval
            factor = Literal(np.array(size, aval.dtype), jax.core.ShapedArray((), aval.dtype))
            eqns.append(
                jcore.new_jaxpr_eqn([x, factor], [out], _lax.mul_p, {}, set(), e.source_info, e.ctx)
            )
    if not changed:
        return jaxpr
    return jaxpr.replace(eqns=eqns)


def is_tracer(x: Any) -> bool:
    """``x`` is a value being traced (by jit, grad, scan, ...), not a concrete one."""
    return isinstance(x, _core.Tracer)


def tracing() -> bool:
    """Whether a JAX transformation is tracing (``jax.jit``, ``grad``, ``scan``, ...)."""
    return not isinstance(_core.trace_ctx.trace, _core.EvalTrace)


def is_ref(x: Any) -> bool:
    """A mutable array reference (``jax.new_ref``)."""
    ref = getattr(jax, "Ref", None)
    return ref is not None and isinstance(x, ref)


def is_ref_aval(aval: Any) -> bool:
    from jax._src.state import types as st

    return isinstance(aval, st.AbstractRef)


def dce_jaxpr(jaxpr: Any, used_outputs: Sequence[bool], keep_inputs: Any = False) -> Any:
    """JAX's dead-code elimination: ``(jaxpr with only the work for used_outputs, the
    inputs it kept)``; ``keep_inputs`` (bools) keeps inputs even when unused."""
    from jax._src.interpreters import partial_eval as pe

    return pe.dce_jaxpr(jaxpr, list(used_outputs), keep_inputs)


def retype_literal_value(val: Any, aval: Any) -> Any:
    """A literal's value with a new type: JAX's typed array literals carry their aval."""
    from jax._src import literals as _literals

    if isinstance(val, _literals.TypedNdArray):
        return _literals.TypedNdArray(np.asarray(val), aval=aval)
    return val


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation: its invars are consts, carry,
    xs; its outvars carry, ys. JAX <= 0.10 has them as params; newer JAX packs them in
    ``ft_in`` (a flat tree of (consts, carry, xs))."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _xs = params["ft_in"].unpack()
    return len(list(consts.vals)), len(list(carry.vals))


def scalar_aval(dtype: Any) -> Any:
    """The abstract value of a scalar of ``dtype``."""
    return jax.core.ShapedArray((), np.dtype(dtype))


def dynamic_slice_eqn(eqn: Any, invars: list[Any], sizes: tuple[int, ...]) -> Any:
    """``eqn`` (a static ``slice``) as a ``dynamic_slice`` of ``invars`` (operand, then
    one scalar start index per dimension), with the same output."""
    return eqn.replace(
        primitive=jax.lax.dynamic_slice_p, invars=invars, params={"slice_sizes": sizes}
    )


def distributed_state() -> Any:
    """JAX's distributed runtime state (``client``: the coordination service's key-value
    client, ``coordinator_address``); both ``None`` before ``jax.distributed.initialize``."""
    from jax._src import distributed

    return distributed.global_state


# --- an mm.jit function called under another transformation --------------------------------

_ABSTRACT_CALL: Any = None


def abstract_call(
    leaves: Sequence[Any], outs: Sequence[Any], name: str, error: Callable[[], Exception]
) -> list[Any]:
    """Bind an opaque ``mm_jit_call`` equation with the output types of ``outs``
    (``jax.ShapeDtypeStruct``s): under a
    tracing-only transformation (``jax.eval_shape``, ``jax.make_jaxpr``,
    ``jax.jit(...).trace``) the outputs are the right shapes; anything that would run,
    differentiate or batch it (lowering, ``grad``, ``vmap``) raises ``error()``."""
    global _ABSTRACT_CALL
    if _ABSTRACT_CALL is None:
        from jax.interpreters import ad, batching, mlir

        prim = jcore.Primitive("mm_jit_call")
        prim.multiple_results = True
        prim.def_abstract_eval(lambda *_avals, out_avals, name, refusal: list(out_avals))

        # the parameter is not named ``error``: checkify's default rule takes that name
        def refuse(*_a: Any, refusal: Callable[[], Exception], **_kw: Any) -> Any:
            raise refusal()

        prim.def_impl(refuse)
        ad.primitive_jvps[prim] = lambda _p, _t, *, refusal, **_kw: refuse(refusal=refusal)
        batching.primitive_batchers[prim] = lambda _a, _d, *, refusal, **_kw: refuse(
            refusal=refusal
        )
        mlir.register_lowering(prim, lambda _ctx, *_a, refusal, **_kw: refuse(refusal=refusal))
        from jax._src.interpreters import partial_eval as pe

        # never dropped as dead code (its lowering is what raises: an unused call under
        # jax.jit must not run silently without its effects). The rule's arguments
        # differ between jax versions; the equation comes last in both.
        pe.dce_rules[prim] = lambda *a: ([True] * len(a[-1].invars), a[-1])
        _ABSTRACT_CALL = prim
    out_avals = tuple(
        _core.ShapedArray(o.shape, o.dtype, weak_type=bool(getattr(o, "weak_type", False)))
        for o in outs
    )
    return _ABSTRACT_CALL.bind(*leaves, out_avals=out_avals, name=name, refusal=error)


@functools.cache
def negative_static_argnums_from_call() -> bool:
    """Whether ``jax.jit`` counts a negative ``static_argnums`` from the end of each
    call's positional arguments (jax 0.10) or of the function's signature (jax 0.12):
    ``f(a, b=0)`` with ``static_argnums=-1`` called as ``f(1)``, asked once."""
    import jax.numpy as jnp

    traced: list[bool] = []

    def f(a: Any, b: Any = 0) -> Any:
        traced.append(isinstance(a, jax.core.Tracer))
        return jnp.zeros(())

    try:
        jax.jit(f, static_argnums=-1).trace(1)
    except Exception:  # noqa: BLE001  (a context that refuses tracing: the newer rule)
        return False
    return bool(traced) and not traced[0]


def settle_effects() -> BaseException | None:
    """Wait for the side effects (callbacks) of this thread's dispatched computations,
    as JAX's exit handlers do. Where one failed, JAX's handler raises it again, which
    skips ``jax.distributed``'s shutdown (its peers then abort). The failure is returned
    here and the tokens are cleared, so JAX's own exit goes on."""
    tokens = getattr(_dispatch, "runtime_tokens", None)
    if tokens is None:
        return None
    try:
        tokens.block_until_ready()
    except Exception as e:  # noqa: BLE001 - the computation's own failure
        tokens.clear()
        return e
    return None
