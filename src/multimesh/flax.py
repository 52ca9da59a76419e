"""Flax integration: place NNX and Linen modules on submeshes.

``mm.flax.task(module, stage=i)`` returns a module whose ``__call__`` runs inside
``mm.task``; its parameters, state and ``nnx.split``/``merge``/``jit``/``grad`` work as
before, with the same parameter paths. For NNX, which records no module names in the
name stack, this is how layers are placed without editing them; for Linen, ``task_rules``
on module paths work as well. :func:`init` creates parameters (and optimizer state)
directly on the submesh where they are used, so that nothing is materialised on another
device first.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from multimesh import _compat
from multimesh.compiler.keys import is_key
from multimesh.tasks import ByLayer
from multimesh.tasks import task as _task

_compat.register_exclusion(__file__)

_CLASSES: dict[Any, type] = {}
# while mm.flax.init traces: Linen module path -> the logical axis rules of its task
_RULES_BY_PATH: contextvars.ContextVar[dict[tuple, Any] | None] = contextvars.ContextVar(
    "multimesh_linen_rules", default=None
)


def _module_task(module: Any, stage: Any) -> Any:
    """The task of an NNX module ``mm.flax.task`` wrapped (its name, mesh and rules), on
    ``stage``."""
    return _task(
        module.mm_task_name,
        stage=stage,
        mesh=module.mm_mesh,
        logical_axis_rules=getattr(module, "mm_rules", None),
    )


def _nnx_class(cls: type) -> type:
    """A subclass of ``cls`` (same name) whose ``__call__`` runs inside the instance's task."""
    if cls in _CLASSES:
        return _CLASSES[cls]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        with _module_task(self, self.mm_stage):
            return cls.__call__(self, *args, **kwargs)

    sub = type(
        cls.__name__,
        (cls,),
        {
            "__call__": __call__,
            "__qualname__": cls.__qualname__,
            "__module__": cls.__module__,
            "_mm_task_class": True,
        },
    )
    _CLASSES[cls] = sub
    return sub


def _linen_class(
    cls: type, stage: int | None, mesh: Mesh | None, name: str | None, rules: Any = None
) -> type:
    key = (cls, ("linen", stage, mesh, name, rules))
    if key in _CLASSES:
        return _CLASSES[key]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        reg = _RULES_BY_PATH.get()
        if reg is not None and rules and getattr(self, "scope", None) is not None:
            reg[tuple(self.scope.path)] = rules  # for mm.flax.init's declared shardings
        with _task(name or cls.__name__, stage=stage, mesh=mesh, logical_axis_rules=rules):
            return cls.__call__(self, *args, **kwargs)

    sub = type(
        cls.__name__,
        (cls,),
        {"__call__": __call__, "__qualname__": cls.__qualname__, "__module__": cls.__module__},
    )
    _CLASSES[key] = sub
    return sub


def task(
    module: Any,
    *,
    stage: int | None = None,
    mesh: Mesh | None = None,
    name: str | None = None,
    logical_axis_rules: Any = None,
) -> Any:
    """Run a Flax module (and its gradient) on one submesh (with its own
    ``logical_axis_rules``, if given: see :func:`multimesh.task`).

    - an NNX module instance: returned (same object, same parameter paths) with its
      ``__call__`` inside ``mm.task``;
    - a Linen module class: a subclass (same name, so the same parameter paths);
    - a Linen module instance: an equal instance of that subclass (one made inside a
      ``@nn.compact`` method, which already holds its name there, is made an instance of
      it in place).
    """
    if (stage is None) == (mesh is None):
        raise ValueError(
            f"mm.flax.task: give exactly one of stage= or mesh=; got stage={stage!r}, "
            f"mesh={mesh!r}."
        )
    from flax import linen as nn
    from flax import nnx

    if isinstance(module, nnx.Module):
        cls = type(module)
        base = cls.__mro__[1] if cls.__dict__.get("_mm_task_class") else cls
        object.__setattr__(module, "__class__", _nnx_class(base))
        # plain Python values: NNX keeps them as static attributes in the graphdef
        module.mm_stage = stage
        module.mm_mesh = mesh
        module.mm_task_name = name or base.__name__
        module.mm_rules = (
            tuple((str(k), v) for k, v in logical_axis_rules) if logical_axis_rules else None
        )
        return module
    if isinstance(module, type) and issubclass(module, nn.Module):
        return _linen_class(module, stage, mesh, name, _rules_key(logical_axis_rules))
    if isinstance(module, nn.Module):
        sub = _linen_class(type(module), stage, mesh, name, _rules_key(logical_axis_rules))
        if isinstance(module.parent, nn.Module) and module.name is not None:
            # made inside a compact method: it holds its name in the parent, which a copy
            # could not take (Flax's NameInUseError); it becomes the subclass in place
            object.__setattr__(module, "__class__", sub)
            return module
        fields = {
            f.name: getattr(module, f.name)
            for f in dataclasses.fields(module)
            if f.init and f.name != "parent"
        }
        return sub(**fields)
    raise TypeError(
        f"mm.flax.task takes an NNX module, a Linen module or a Linen module class; got "
        f"{type(module).__name__}."
    )


def _rules_key(rules: Any) -> Any:
    return tuple((str(k), v) for k, v in rules) if rules else None


def init(
    fn: Callable[..., Any],
    *,
    mesh: Any,
    stages: Any = None,
    task_rules: Any = None,
    shardings: Any = "declared",
) -> Callable[..., Any]:
    """``fn`` (e.g. ``model.init`` or an NNX constructor returning ``nnx.state``) under
    ``mm.jit``, each output leaf created on its stage and with its sharding.

    ``stages``: a pytree prefix of the outputs (ints), or a callable
    ``(key_path, leaf) -> stage``; ``None`` leaves placement to the tasks and
    ``task_rules`` of the model. ``shardings``: ``"declared"`` (default) shards each leaf
    as the model declares it (Linen ``nn.with_partitioning`` /
    ``nn.with_logical_partitioning`` boxes, logical names resolved by the active
    ``nn.logical_axis_rules``), ``None`` lets XLA choose, or a pytree prefix of
    ``PartitionSpec``s (or a callable ``(key_path, leaf) -> PartitionSpec``) on each leaf's
    submesh. Initialisers that depend only on the PRNG key and constants are recomputed on
    the stage that needs each leaf, so nothing is materialised on another submesh first.
    """
    from multimesh.api import jit

    def placed(*args: Any, **kwargs: Any) -> Any:
        rules_by_path: dict[tuple, Any] = {}
        tok = _RULES_BY_PATH.set(rules_by_path)
        try:
            out = fn(*args, **kwargs)
        finally:
            _RULES_BY_PATH.reset(tok)
        leaves, tree = jax.tree_util.tree_flatten_with_path(out, is_leaf=_is_box)
        # a box keeps the rules of the task that made it, so state made from it later
        # (an optimizer's, through mm.flax.init(tx.init)) resolves its names the same way
        leaves = [(path, _with_rules(x, _rules_for(path, rules_by_path))) for path, x in leaves]
        stage_of = _per_leaf(stages, out, leaves, "stages")
        spec_of = (
            [_declared_spec(x) for _path, x in leaves]
            if isinstance(shardings, str) and shardings == "declared"
            else _per_leaf(shardings, out, leaves, "shardings")
        )
        new = []
        for (_path, x), st, spec in zip(leaves, stage_of, spec_of):
            value = x.unbox() if _is_box(x) else x
            if _is_num(value):

                def make(y: Any, spec: Any = spec) -> Any:
                    y = y + 0
                    if spec is not None:
                        y = jax.lax.with_sharding_constraint(y, spec)
                    return y

                value = _task("init", stage=int(st))(make)(value) if st is not None else make(value)
            new.append(x.replace_boxed(value) if _is_box(x) else value)
        return jax.tree_util.tree_unflatten(tree, new)

    return jit(functools.wraps(fn)(placed), mesh=mesh, task_rules=task_rules)


def _is_box(x: Any) -> bool:
    from flax.core import meta

    return isinstance(x, meta.AxisMetadata)


def _with_rules(x: Any, rules: Any) -> Any:
    """A Linen ``LogicallyPartitioned`` box without rules of its own given ``rules``."""
    from flax import linen as nn

    if rules and isinstance(x, nn.LogicallyPartitioned) and not getattr(x, "rules", None):
        return x.replace(rules=rules)
    return x


def _rules_for(path: Any, rules_by_path: dict[tuple, Any]) -> Any:
    """The logical rules of the innermost task-wrapped Linen module holding ``path``."""
    keys = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    best, found = -1, None
    for mpath, rules in rules_by_path.items():
        n = len(mpath)
        # params paths are (collection, *module path, name)
        if n > best and keys[1 : 1 + n] == tuple(mpath):
            best, found = n, rules
    return found


def _declared_spec(x: Any) -> Any:
    """The PartitionSpec a Linen box declares (logical names through the rules of the
    box, given it by the task that created it, or the active ``nn.logical_axis_rules``)."""
    if not _is_box(x):
        return None
    from flax import linen as nn

    names = getattr(x, "names", None)
    if names is None:
        return None
    if isinstance(x, nn.LogicallyPartitioned):
        return nn.logical_to_mesh_axes(names, getattr(x, "rules", None))
    return jax.sharding.PartitionSpec(*names)


def _per_leaf(spec_tree: Any, out: Any, leaves: list[Any], what: str) -> list[Any]:
    if spec_tree is None:
        return [None] * len(leaves)
    if callable(spec_tree):
        return [spec_tree(path, x) for path, x in leaves]
    try:
        return jax.tree_util.tree_leaves(
            jax.tree.map(
                lambda s, sub: jax.tree.map(lambda _: s, sub, is_leaf=_is_box),
                spec_tree,
                out,
                is_leaf=lambda v: v is None or isinstance(v, jax.sharding.PartitionSpec),
            ),
            is_leaf=lambda v: v is None or isinstance(v, jax.sharding.PartitionSpec),
        )
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"mm.flax.init({what}=...) must be a pytree prefix of the outputs or a callable "
            f"(key_path, leaf) -> value: {e}"
        ) from None


def _is_num(x: Any) -> bool:
    return hasattr(x, "dtype") and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)


def _copy(y: Any) -> Any:
    """``y`` made again by an operation where it is called (in a task: on its submesh);
    a PRNG key (an ``nnx.Rngs`` stream's) through its key data."""
    if is_key(y):
        impl = jax.random.key_impl(y)
        return jax.random.wrap_key_data(jax.random.key_data(y) + 0, impl=impl)
    return y + 0


def _by_layer(owner: Any, path: tuple, value: jax.Array, shard: Callable[..., Any]) -> jax.Array:
    """A stacked variable of a ``by_layer`` task, made layer by layer on their stages
    (a scan over the leading axis, as the model's own scan runs it)."""
    if jax.numpy.ndim(value) == 0:
        raise ValueError(
            f"mm.flax.create: variable {'/'.join(map(str, path))} of task "
            f"{owner.mm_task_name!r} (stage=mm.by_layer()) has no leading layer axis"
        )

    def body(carry: None, row: jax.Array) -> tuple[None, jax.Array]:
        with _module_task(owner, owner.mm_stage):
            return carry, shard(_copy(row), layer_axis=True)

    return jax.lax.scan(body, None, value)[1]


def _deferred_sharding(var: Any, eager: bool) -> Callable[..., Any]:
    """The sharding constraint Flax would have put on ``var`` as it was made (by its
    ``out_sharding`` names through the logical rules active where it is called: its
    task's own), for :func:`create`, which makes variables with eager sharding off."""
    from flax import nnx

    if not eager or var.get_metadata("eager_sharding", True):
        return lambda y, layer_axis=False: y
    if not var.get_metadata("out_sharding", None):
        return lambda y, layer_axis=False: y

    def shard(y: jax.Array, layer_axis: bool = False) -> jax.Array:
        spec = nnx.get_partition_spec(var).get_value()  # resolved by the active rules
        if spec is None:
            return y
        if layer_axis:  # one row of a stacked variable: its spec without the layer axis
            spec = jax.sharding.PartitionSpec(*tuple(spec)[1:])
        m = var.get_metadata("mesh", None)
        return jax.lax.with_sharding_constraint(
            y, jax.sharding.NamedSharding(m, spec) if m is not None else spec
        )

    return shard


def create(ctor: Callable[..., Any], *args: Any, mesh: Any) -> Any:
    """Build an NNX model under ``mm.jit`` so each parameter is created on the submesh of
    the ``mm.flax.task`` that owns it (and nowhere else).

    ``model = mm.flax.create(lambda key: Model(cfg, rngs=nnx.Rngs(key)), key, mesh=mmesh)``

    Variables annotated with shardings (``nnx.with_partitioning``) are sharded there by
    the logical rules of their task (``mm.flax.task(..., logical_axis_rules=)``, else the
    active ones), and keep ``eager_sharding=False`` in their metadata, so state made from
    them (``nnx.Optimizer``) stays with each parameter instead of being sharded again on
    the global mesh.
    """
    from flax import nnx

    from multimesh.api import jit

    box: dict[str, Any] = {}
    eager = nnx.using_eager_sharding()

    def build(*a: Any) -> Any:
        # Flax shards an annotated variable as it is made, by the rules active then; the
        # rules of the task that owns it (mm.flax.task(..., logical_axis_rules=)) are known
        # only once the model is built, so its sharding waits until it is placed
        with nnx.use_eager_sharding(False):
            model = ctor(*a)
        owners: list[tuple[tuple, Any]] = []
        for path, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Module) and getattr(node, "mm_stage", None) is not None:
                owners.append((tuple(path), node))
            elif isinstance(node, nnx.Module) and getattr(node, "mm_mesh", None) is not None:
                owners.append((tuple(path), node))
        owners.sort(key=lambda o: -len(o[0]))
        for path, node in nnx.iter_graph(model):
            if not isinstance(node, nnx.Variable):
                continue
            if not (_is_num(node.get_value()) or is_key(node.get_value())):
                continue
            path = tuple(path)
            shard = _deferred_sharding(node, eager)
            for opath, owner in owners:
                if path[: len(opath)] == opath:
                    stage = owner.mm_stage
                    if isinstance(stage, ByLayer):  # stacked layers: each on its own stage
                        node.set_value(_by_layer(owner, path, node.get_value(), shard))
                        break
                    if stage is not None:  # virtual (interleaved) stage -> its submesh
                        stage = stage % mesh.num_stages
                    place = _module_task(owner, stage)
                    node.set_value(place(lambda y, shard=shard: shard(_copy(y)))(node.get_value()))
                    break
            else:
                node.set_value(shard(node.get_value()))
        if eager:
            # variables without shardings: their metadata as made outside create. Those
            # with one keep eager sharding off: they are placed, and state made from them
            # (nnx.Optimizer's) keeps that placement instead of being sharded again on
            # the global mesh by rules that are not its task's (which fails)
            for _path, node in nnx.iter_graph(model):
                if (
                    isinstance(node, nnx.Variable)
                    and not node.get_metadata("eager_sharding")
                    and not node.get_metadata("out_sharding", None)
                ):
                    node.set_metadata("eager_sharding", True)
        graphdef, state = nnx.split(model)
        box["graphdef"] = graphdef
        return state

    state = jit(build, mesh=mesh)(*args)
    return nnx.merge(box["graphdef"], state)
