"""Arguments of an ``mm.jit`` function: static and donated arguments, signature keys,
argument names, and the ``in_shardings`` / ``out_shardings`` a user gives.

``jax.jit`` semantics throughout: static arguments are hashable and part of the cache
key (negative indices count from the end of the signature), ``in_shardings`` is one
sharding for every argument or a tuple with one pytree prefix per positional dynamic
argument, and ``out_shardings`` a pytree prefix of the outputs. What cannot work is a
clear error naming the argument.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from multimesh import _compat

_compat.register_exclusion(__file__)

_ARRAY = _compat.ARRAY_TYPE

_SPEC_TYPES = (Sharding, PartitionSpec)


@dataclasses.dataclass
class Call:
    """A normalised call: static arguments split from dynamic ones."""

    dyn_args: tuple[Any, ...]
    dyn_kwargs: dict[str, Any]
    static: Hashable  # the static part of the cache key
    positions: tuple[int, ...]  # original positional index of each dynamic argument
    rebuild: Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]


class Signature:
    """What an ``mm.jit`` knows about its function's parameters."""

    def __init__(
        self,
        fun: Callable[..., Any],
        static_argnums: Sequence[int] | None,
        static_argnames: Sequence[str] | None,
        donate_argnums: Sequence[int] | None,
        donate_argnames: Sequence[str] | None,
    ) -> None:
        # as jax.jit: numbers and names infer each other only when one of the pair is
        # omitted (None); given both, each means only what it says
        infer_static = static_argnums is None or static_argnames is None
        infer_donate = donate_argnums is None or donate_argnames is None
        static_argnums, static_argnames = static_argnums or (), static_argnames or ()
        donate_argnums, donate_argnames = donate_argnums or (), donate_argnames or ()
        try:
            sig = inspect.signature(fun)
        except (TypeError, ValueError):
            sig = None
        params = list(sig.parameters.values()) if sig is not None else []
        positional = [
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self.varargs = sig is None or any(p.kind == p.VAR_POSITIONAL for p in params)
        self.param_names = positional
        #: ``*xs``'s name: extra positional arguments are ``xs[i]`` (as jax.jit names them)
        self.varargs_name = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), "args")
        n = len(positional)

        def resolve(nums: Sequence[int], what: str, from_call: bool = False) -> tuple[int, ...]:
            out = []
            for i in nums:
                if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                    raise TypeError(f"mm.jit({what}=...) takes ints, got {i!r}.")
                i = int(i)
                if i < 0 and not self.varargs:
                    if i < -n:
                        raise ValueError(
                            f"mm.jit({what}={i}) is out of range for a function with {n} "
                            "positional parameters."
                        )
                    if not from_call:
                        i += n
                out.append(i)
            return tuple(out)

        # a negative static argnum counts as jax.jit's does: from the end of each call's
        # positional arguments on jax 0.10 (f(a, b, 4) with static_argnums=-1 and a
        # defaulted 4th parameter makes the 3rd static), of the signature on jax 0.12
        negative = any(isinstance(i, (int, np.integer)) and i < 0 for i in static_argnums)
        self.static_argnums = resolve(
            static_argnums,
            "static_argnums",
            negative and _compat.negative_static_argnums_from_call(),
        )
        self.donate_argnums = resolve(donate_argnums, "donate_argnums")
        self.static_argnames = tuple(static_argnames)
        self.donate_argnames = tuple(donate_argnames)
        # names <-> positions, as jax.jit does (when one of the pair is omitted)
        self.static_names = set(self.static_argnames) | {
            positional[i] for i in self.static_argnums if 0 <= i < n and infer_static
        }
        self.static_pos = {i for i in self.static_argnums if i >= 0} | {
            i for i, p in enumerate(positional) if p in self.static_argnames and infer_static
        }
        self.donate_names = set(self.donate_argnames) | {
            positional[i] for i in self.donate_argnums if 0 <= i < n and infer_donate
        }
        self.donate_pos = {i for i in self.donate_argnums if i >= 0} | {
            i for i, p in enumerate(positional) if p in self.donate_argnames and infer_donate
        }
        self._neg_static = tuple(i for i in self.static_argnums if i < 0)
        self._neg_donate = tuple(i for i in self.donate_argnums if i < 0)
        if sig is not None:
            self._check_against(params, n)

    def _check_against(self, params: list[inspect.Parameter], n: int) -> None:
        """Argument numbers and names the function has, as ``jax.jit`` checks them: a typo
        would otherwise turn staticness or donation off without a word."""
        for what, nums in (("static_argnums", self.static_argnums),
                           ("donate_argnums", self.donate_argnums)):
            bad = [i for i in nums if i >= n]
            if bad and not self.varargs:
                raise ValueError(
                    f"mm.jit({what}={bad[0]}): the function takes only {n} positional "
                    f"argument{'s' if n != 1 else ''} ({', '.join(self.param_names) or 'none'})."
                )
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            only_pos = {p.name for p in params if p.kind == p.POSITIONAL_ONLY}
            for what, names in (("static_argnames", self.static_argnames),
                                ("donate_argnames", self.donate_argnames)):
                for name in names:
                    if name in only_pos:
                        raise ValueError(
                            f"mm.jit({what}={name!r}): that parameter is positional-only; "
                            f"use {what.replace('argnames', 'argnums')}."
                        )
                    if name not in named:
                        raise ValueError(
                            f"mm.jit({what}={name!r}): the function has no parameter of that "
                            f"name (it has {', '.join(sorted(named)) or 'none'})."
                        )
        both = sorted(self.static_pos & self.donate_pos)
        names = sorted(self.static_names & self.donate_names)
        if both or names:
            which = f"argument {both[0]}" if both else f"argument {names[0]!r}"
            raise ValueError(
                f"mm.jit: {which} is both static and donated; a static argument is not "
                "an array on the devices and cannot be donated (as in jax.jit)."
            )

    def normalize(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        nargs = len(args)
        if self._neg_static and min(self._neg_static) < -nargs:
            raise ValueError(
                f"mm.jit(static_argnums={min(self._neg_static)}) counts from the end of the "
                f"call's positional arguments, but this call passes {nargs} (as jax.jit, "
                "negative indices must be >= -len(args)); pass the static argument "
                "positionally, or name it in static_argnames."
            )
        static_pos = self.static_pos | {i + nargs for i in self._neg_static}
        statics = tuple((i, args[i]) for i in sorted(static_pos) if 0 <= i < nargs)
        skw = tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_names))
        positions = tuple(i for i in range(nargs) if i not in static_pos)
        dyn_args = tuple(args[i] for i in positions)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_names}
        # values and their types, as jax.jit: 1, 1.0 and True are equal, not the same
        static_key = (
            tuple((i, type(v), v) for i, v in statics),
            tuple((k, type(v), v) for k, v in skw),
            nargs,
        )
        try:
            hash(static_key)
        except TypeError:
            bad = [v for _, v in statics + skw if not _hashable(v)]
            raise ValueError(  # jax.jit's type for this error
                f"static arguments of mm.jit must be hashable (like jax.jit's); got "
                f"{type(bad[0]).__name__ if bad else 'an unhashable value'}: {bad[:1]}. "
                "Pass it as a dynamic argument, or make it hashable (e.g. a tuple)."
            ) from None

        def rebuild(dargs: tuple[Any, ...], dkw: dict[str, Any]):
            it = iter(dargs)
            sd = dict(statics)
            full = tuple(sd[i] if i in sd else next(it) for i in range(nargs))
            return full, {**dkw, **dict(skw)}

        return Call(dyn_args, dyn_kwargs, static_key, positions, rebuild)

    def donated_leaves(self, call: Call) -> frozenset[int]:
        """Flat leaf indices of the donated dynamic arguments."""
        nargs = call.static[2]  # type: ignore[index]
        donate = self.donate_pos | {i + nargs for i in self._neg_donate}
        if not donate and not self.donate_names:
            return frozenset()
        out: set[int] = set()
        pos = 0
        for k, a in enumerate(call.dyn_args):
            n = len(jax.tree_util.tree_leaves(a))
            if call.positions[k] in donate:
                out.update(range(pos, pos + n))
            pos += n
        for name in sorted(call.dyn_kwargs):
            n = len(jax.tree_util.tree_leaves(call.dyn_kwargs[name]))
            if name in self.donate_names:
                out.update(range(pos, pos + n))
            pos += n
        return frozenset(out)

    def leaf_names(self, call: Call) -> list[str]:
        """A readable name for each flat leaf: ``params['w0']``, ``x``, ``args[2][0]``."""
        names: list[str] = []
        for k, a in enumerate(call.dyn_args):
            p = call.positions[k]
            n = len(self.param_names)
            base = self.param_names[p] if p < n else f"{self.varargs_name}[{p - n}]"
            for path, _ in jax.tree_util.tree_leaves_with_path(a):
                names.append(base + jax.tree_util.keystr(path))
        for name in sorted(call.dyn_kwargs):
            for path, _ in jax.tree_util.tree_leaves_with_path(call.dyn_kwargs[name]):
                names.append(name + jax.tree_util.keystr(path))
        return names


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


# --- signature keys ------------------------------------------------------------------


def _aval_of(x: Any) -> Any:
    return jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)


# bool first: a bool is an int
_SCALAR_DTYPES = {bool: np.bool_, int: np.int64, float: np.float64, complex: np.complex128}


def fit_key_shardings(flat: list[Any]) -> None:
    """Typed PRNG key arguments whose sharding has entries beyond their rank that split
    nothing (``None``, size-1 axes), re-labelled in place without them (the same
    buffers): jax 0.10's
    ``wrap_key_data`` of key data sharded ``P(None)`` on a one-device mesh gives the key
    ``P(None,)``, which ``jax.jit`` takes but a program's typed input refuses."""
    done: dict[int, Any] = {}  # one array passed twice stays one (the donation checks)
    for i, x in enumerate(flat):
        if type(x) is _ARRAY or not isinstance(x, jax.Array) or not is_extended(x.dtype):
            continue
        if id(x) in done:
            flat[i] = done[id(x)]
            continue
        sh = x.sharding
        if not isinstance(sh, NamedSharding) or len(sh.spec) <= x.ndim:
            continue
        spec = tuple(sh.spec)
        sizes = dict(sh.mesh.shape)
        unit = all(  # entries past the rank that split nothing: None or size-1 axes
            e is None or all(sizes.get(a, 0) == 1 for a in ((e,) if isinstance(e, str) else e))
            for e in spec[x.ndim :]
        )
        if unit and not x.is_deleted():
            fit = NamedSharding(sh.mesh, PartitionSpec(*spec[: x.ndim]), memory_kind=sh.memory_kind)
            flat[i] = done[id(x)] = relabeled(x, fit)


def relabeled(x: jax.Array, sh: Any) -> jax.Array:
    """``x``'s buffers as an array with sharding ``sh`` (the same devices and pieces):
    no copy, unlike ``jax.device_put``, which keeps an equivalent sharding as it is."""
    shards = [a.data for a in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, sh, shards)


def leaf_key(x: Any, structs: bool = True) -> tuple[Any, ...]:
    """The cache-key part of one flat argument: (shape, dtype, weak type, committed
    sharding or None). Traced values and deleted (donated) arrays are errors, and so are
    ``jax.ShapeDtypeStruct``s unless ``structs`` (lowering takes them, calls do not)."""
    if type(x) is _ARRAY:  # the common case, without the isinstance checks below
        if not structs and x.is_deleted():  # lowering needs only its type (as jax.jit)
            raise DeletedArgument()
        aval = x.aval
        return (aval.shape, aval.dtype, bool(aval.weak_type), x.sharding if x._committed else None)
    if isinstance(x, jax.Array):
        if isinstance(x, jax.core.Tracer):
            raise traced_error()
        if not structs and x.is_deleted():
            raise DeletedArgument()
        committed = getattr(x, "committed", False)
        return (
            x.shape,
            x.dtype,
            bool(getattr(x.aval, "weak_type", False)),
            x.sharding if committed else None,
        )
    if isinstance(x, np.ndarray):  # float64 is float32 unless x64 is on (as in jax.jit)
        return (x.shape, jax.dtypes.canonicalize_dtype(x.dtype), False, None)
    if isinstance(x, np.generic):  # before Python scalars: np.float64 is a float
        return ((), jax.dtypes.canonicalize_dtype(x.dtype), False, None)
    if isinstance(x, (bool, int, float, complex)):
        # subclasses (an IntEnum member) as their Python type, as jax.jit
        return (next(t for t in _SCALAR_DTYPES if isinstance(x, t)),)
    if _compat.is_ref(x):
        raise TypeError(
            "a mutable array reference (jax.new_ref) cannot be an mm.jit argument (its "
            "writes would have to reach the caller from another submesh); pass the array "
            "(ref[...]) and return its new value, or create the reference inside the "
            "function, within one task."
        )
    if isinstance(x, jax.ShapeDtypeStruct):
        if not structs:
            raise TypeError(
                f"{x} is a jax.ShapeDtypeStruct, not a value: a call needs arrays (as "
                "jax.jit). For shapes only use .lower(...), .trace(...) or .eval_shape(...)."
            )
        sh = x.sharding if isinstance(x.sharding, Sharding) else None
        return (
            tuple(x.shape),
            np.dtype(x.dtype) if not is_extended(x.dtype) else x.dtype,
            bool(getattr(x, "weak_type", False)),
            sh,
        )
    try:
        aval = _aval_of(x)
    except TypeError:
        raise TypeError(
            f"mm.jit arguments must be arrays, scalars or pytrees of them; got a "
            f"{type(x).__name__}. Mark it static (static_argnums/static_argnames) if it "
            "is configuration."
        ) from None
    return (aval.shape, aval.dtype, getattr(aval, "weak_type", False), None)


class DeletedArgument(RuntimeError):
    """Raised by :func:`leaf_key` for a deleted array; callers name the argument."""


def deleted_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"argument {name} has been deleted: it was donated to an earlier call (donate_argnums)"
        " or deleted explicitly. Pass that call's output instead of the donated input."
    )


def traced_error() -> TypeError:
    return TypeError(
        "mm.jit was called with traced values (inside jax.jit, jax.grad, jax.vmap, ...). "
        "mm.jit must be the outermost transformation: put the transformation inside, e.g. "
        "mm.jit(jax.grad(loss), mesh=mmesh) instead of jax.grad(mm.jit(loss, mesh=mmesh)). "
        "For output shapes use jax.eval_shape(f, ...) or f.eval_shape(...), or "
        "f.lower(...) for the plan."
    )


def is_extended(dtype: Any) -> bool:
    """Whether ``dtype`` is an extended dtype (PRNG keys); ``None`` is not."""
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def resolved_structs(flat: list[Any]) -> list[Any]:
    """``jax.ShapeDtypeStruct``s with a bare ``PartitionSpec`` get their sharding from the
    caller's mesh (``jax.set_mesh``) when read: read it here, in the caller's context, as
    planning runs outside it. Deleted (donated) arrays become their structs: lowering
    needs only their types, as ``jax.jit(f).lower`` does."""
    out = []
    for x in flat:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
            x = jax.ShapeDtypeStruct(
                x.shape,
                x.dtype,
                sharding=x.sharding if getattr(x, "committed", False) else None,
                weak_type=bool(getattr(x.aval, "weak_type", False)),
            )
        if isinstance(x, jax.ShapeDtypeStruct):
            try:
                sh = x.sharding
            except Exception:  # noqa: BLE001 - no mesh to resolve it on: JAX says so later
                sh = None
            if isinstance(sh, Sharding):
                x = jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=sh, weak_type=bool(getattr(x, "weak_type", False))
                )
        out.append(x)
    return out


def trace_arg(x: Any) -> Any:
    """Trace on shape and dtype only: where an input lives is the planner's business,
    and avals carrying a submesh would clash with the mesh the program is traced on."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return jax.ShapeDtypeStruct(
            x.shape,
            x.dtype,
            weak_type=bool(getattr(x, "weak_type", False))
            if isinstance(x, jax.ShapeDtypeStruct)
            else bool(getattr(x.aval, "weak_type", False)),
        )
    return x


def describe(key: tuple[Any, ...]) -> str:
    """``float32[8,4]`` for a leaf key."""
    if len(key) == 1:
        return f"Python {key[0].__name__}"
    shape, dtype = key[0], key[1]
    return f"{dtype}[{','.join(str(d) for d in shape)}]"


def placement_text(sh: Any) -> str:
    """A sharding for an error message, naming its devices (a one-device submesh's mesh
    has no axes, and prints as ``Mesh(, ...)``)."""
    if isinstance(sh, NamedSharding):
        axes = ", ".join(f"{n}={k}" for n, k in sh.mesh.shape.items())
        ids = [int(d.id) for d in sh.mesh.devices.flat]
        return f"NamedSharding(devices {ids}{f' ({axes})' if axes else ''}, spec {sh.spec})"
    if _compat.is_single_device_sharding(sh):
        return f"device {int(next(iter(sh.device_set)).id)}"
    return str(sh)


def check_call_types(
    names: list[str],
    got: Sequence[tuple[Any, ...]],
    want: Sequence[tuple[Any, ...]],
    avals: Sequence[Any],
) -> None:
    """Raise ``TypeError`` (like ``jax.stages.Compiled``) where an argument's shape or
    dtype differs from what was compiled (``avals``: the compiled argument types, which
    a Python scalar is checked against as JAX types it now: ``jax_enable_x64`` may have
    changed since)."""
    bad = []
    for k, (name, g, w) in enumerate(zip(names, got, want)):
        if len(g) == 1:
            now, then = abstract_leaf_key(g), avals[k]
            if now[:2] != (tuple(then.shape), then.dtype):
                bad.append(
                    f"argument {name} compiled with {describe((tuple(then.shape), then.dtype))} "
                    f"and called with {describe(now)} (a {g[0].__name__})"
                )
            continue
        if g[:2] == w[:2] or g == w:
            continue
        if len(g) == 1 or len(w) == 1:  # Python scalars: compare as weak-typed values
            if _scalar_matches(g, w):
                continue
        bad.append(f"argument {name} compiled with {describe(w)} and called with {describe(g)}")
    if bad:
        raise TypeError(
            "argument types differ from the types this mm.jit program was compiled for: "
            + "; ".join(bad)
        )


def abstract_leaf_key(k: tuple[Any, ...]) -> tuple[Any, ...]:
    """(shape, dtype, weak type) of a leaf key: what tracing depends on. A Python scalar
    is its weakly typed 0-d array (bool: strongly typed), so ``f(x, 1.0)`` and
    ``f(x, jnp.asarray(1.0))`` share one trace, as under jax.jit."""
    if len(k) == 1:
        return ((), jax.dtypes.canonicalize_dtype(_SCALAR_DTYPES[k[0]]), k[0] is not bool)
    return k[:3]


def _scalar_matches(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return abstract_leaf_key(a)[:2] == abstract_leaf_key(b)[:2]


# --- in_shardings / out_shardings --------------------------------------------------------


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, _SPEC_TYPES)


def check_spec_value(s: Any, what: str) -> None:
    if not _is_spec_leaf(s):
        raise TypeError(
            f"{what}: expected a jax.sharding.Sharding, a PartitionSpec or None, got "
            f"{type(s).__name__} ({s!r})."
        )


def as_named(tree: Any, what: str) -> Any:
    """``tree`` with each one-device sharding that is not a ``NamedSharding``
    (``SingleDeviceSharding``) made the ``NamedSharding`` of the same placement, so it
    names the submesh of that device as a NamedSharding would; other kinds of sharding
    over several devices are refused, naming ``what``."""

    def one(s: Any) -> Any:
        if not isinstance(s, Sharding) or isinstance(s, NamedSharding):
            return s
        devs = list(s.device_set)
        if len(devs) == 1:
            mesh = jax.sharding.Mesh(np.array(devs), ("_device",))
            return NamedSharding(mesh, PartitionSpec())
        raise TypeError(
            f"{what}: {type(s).__name__} over {len(devs)} devices is not supported; give a "
            "NamedSharding (or a PartitionSpec: the submesh that uses the value)."
        )

    return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: x is None or _is_spec_leaf(x))


def spec_axes(spec: PartitionSpec) -> set[str]:
    out: set[str] = set()
    for e in spec:
        if isinstance(e, str):
            out.add(e)
        elif isinstance(e, tuple):
            out.update(x for x in e if isinstance(x, str))
    return out


def broadcast_prefix(prefix: Any, tree: Any, what: str) -> list[Any]:
    """Expand a pytree prefix of shardings to one entry per leaf of ``tree``."""
    if _is_spec_leaf(prefix):
        return [prefix] * len(jax.tree_util.tree_leaves(tree))
    out: list[Any] = []
    try:
        jax.tree_util.tree_map(
            lambda s, sub: out.extend([s] * len(jax.tree_util.tree_leaves(sub))),
            prefix,
            tree,
            is_leaf=_is_spec_leaf,
        )
    except (ValueError, TypeError):
        raise ValueError(
            f"{what} {jax.tree_util.tree_structure(prefix, is_leaf=_is_spec_leaf)} is not a "
            f"pytree prefix of the value's structure {jax.tree_util.tree_structure(tree)}; "
            "give one sharding, or a matching pytree (None where any placement is fine)."
        ) from None
    for s in out:
        check_spec_value(s, what)
    return out


def in_sharding_leaves(in_shardings: Any, call: Call, names: Sequence[str]) -> list[Any]:
    """One ``in_shardings`` entry per flat leaf (None where none is given)."""
    n_leaves = len(names)
    if in_shardings is None:
        return [None] * n_leaves
    if _is_spec_leaf(in_shardings):
        return [in_shardings] * n_leaves
    if not isinstance(in_shardings, (tuple, list)):
        raise TypeError(
            "mm.jit(in_shardings=...) takes one sharding for all arguments or a tuple with "
            f"one entry per positional argument; got {type(in_shardings).__name__}."
        )
    if call.dyn_kwargs:
        raise ValueError(
            "mm.jit(in_shardings=(...)) covers positional arguments only (as in jax.jit); "
            f"pass {sorted(call.dyn_kwargs)} positionally."
        )
    if len(in_shardings) != len(call.dyn_args):
        raise ValueError(
            f"mm.jit(in_shardings=...) has {len(in_shardings)} entries but the call has "
            f"{len(call.dyn_args)} positional (non-static) arguments; give one entry per "
            "argument (None for any placement)."
        )
    out: list[Any] = []
    k = 0
    for pos, (a, s) in enumerate(zip(call.dyn_args, in_shardings)):
        nleaves = len(jax.tree_util.tree_leaves(a))
        arg = repr(names[k].split("[")[0]) if nleaves else f"at position {call.positions[pos]}"
        out.extend(broadcast_prefix(s, a, f"in_shardings for argument {arg}"))
        k += nleaves
    return out


def check_spec_rank(s: Any, shape: Sequence[int], what: str, noun: str) -> None:
    """A user-given sharding's spec may not have more entries than its value's rank;
    ``what`` names the sharding and the value (``noun``: "output", "argument")."""
    spec = s if isinstance(s, PartitionSpec) else getattr(s, "spec", None)
    if isinstance(spec, PartitionSpec) and len(spec) > len(shape):
        raise ValueError(
            f"{what} has {len(spec)} entries, but that {noun} has rank {len(shape)} "
            f"(shape {tuple(shape)})."
        )


def check_no_stage_axis(s: Any, stage_axis: str | None, what: str) -> None:
    """A user-given sharding may not split a value across stages."""
    if stage_axis is None or s is None:
        return
    spec = s if isinstance(s, PartitionSpec) else getattr(s, "spec", None)
    if isinstance(spec, PartitionSpec) and stage_axis in spec_axes(spec):
        raise ValueError(
            f"{what}: {s} names the stage axis {stage_axis!r}. A value lives on one submesh "
            f"(or is replicated over several); drop {stage_axis!r} from the spec, e.g. "
            f"{drop_axis(spec, stage_axis)}. (Stacked values held per stage come back "
            f"split over {stage_axis!r} by themselves: the outputs of a scan split by "
            "mm.by_layer, updates of a stack whose rows each stage reads (ws[i]), and an "
            f"argument sharded over {stage_axis!r} returned as is; such an argument is "
            "also taken as it is. Give None for them.)"
        )


def drop_axis(spec: PartitionSpec, axis: str) -> PartitionSpec:
    """``spec`` with ``axis`` left out of every entry."""
    return PartitionSpec(*[_drop(e, axis) for e in spec])


def _drop(entry: Any, axis: str) -> Any:
    if entry == axis:
        return None
    if isinstance(entry, tuple):
        kept = tuple(e for e in entry if e != axis)
        return kept or None
    return entry


def is_named(s: Any) -> bool:
    return isinstance(s, NamedSharding)
