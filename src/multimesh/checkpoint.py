"""Checkpoints of MPMD training state, on Orbax.

    mm.checkpoint.save("/ckpt/step-100", state, step=100)
    state = mm.checkpoint.restore("/ckpt/step-100", target)

    manager = mm.checkpoint.CheckpointManager("/ckpt", max_to_keep=3)
    manager.save(step, state)               # asynchronous: training continues
    state = manager.restore(target=state)   # the latest complete step

A state is any pytree of ``jax.Array``s, wherever they live: on different submeshes,
sharded over a stage axis, on other processes' devices. Each process writes the shards
it holds (one replica of each), and a restore reads straight into the target's
shardings, so no process reads more than it needs and nothing is gathered on one
device. The target decides the layout: a checkpoint written with 4 stages restores
into 2 stages, into a TP/DP layout, or into a single device, with the same bits.

``target`` is a pytree of arrays or of ``jax.ShapeDtypeStruct``s with shardings (for
example a freshly initialised state, or ``jax.eval_shape`` plus the shardings a
``mm.jit(...).lower(...)`` reports); leaves without a sharding come back as numpy.
Saves are atomic (Orbax writes to a temporary directory and renames it when done), so
an interrupted save never leaves a checkpoint that restores wrong: the manager restores
the previous complete step. A checkpoint that does not match the target (missing or
extra keys, other shapes or dtypes) is a clear error naming the keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from multimesh import _compat
from multimesh.arguments import relabeled
from multimesh.runtime import crossproc

_compat.register_exclusion(__file__)


def _ocp() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - an optional dependency
        raise ImportError(
            "mm.checkpoint needs Orbax: pip install 'multimesh[checkpoint]' "
            "(or pip install orbax-checkpoint)."
        ) from e
    return ocp


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _key_data_struct(x: Any) -> jax.ShapeDtypeStruct:
    """What a typed PRNG key leaf is stored as: its key data (uint32, a trailing axis)."""
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (data.ndim - len(tuple(sharding.spec)))
        sharding = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=sharding.memory_kind
        )
    elif sharding is not None and not _compat.is_single_device_sharding(sharding):
        raise ValueError(
            f"restoring a PRNG key array into a {type(sharding).__name__} is not supported: "
            "give its target a NamedSharding or a single device"
        )
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


def _abstract(target: Any) -> Any:
    """The target as Orbax restore arguments: arrays keep their shardings; typed PRNG
    keys are their key data (what Orbax stores)."""

    def leaf(x: Any) -> Any:
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and _is_key(x):
            return _key_data_struct(x)
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, (np.ndarray, np.generic, int, float, bool)):
            return np.asarray(x)
        return x

    return jax.tree.map(leaf, target)


def _as_target(got: Any, target: Any) -> Any:
    """Restored leaves typed as the target's: PRNG keys wrapped again, weak types kept
    (Orbax stores neither)."""

    def leaf(g: Any, x: Any) -> Any:
        if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            return g
        if _is_key(x):
            k = g  # Orbax may have wrapped it itself
            if not _is_key(g):
                if isinstance(g, np.ndarray):
                    g = jax.numpy.asarray(g)
                k = jax.random.wrap_key_data(g, impl=_compat.key_impl(x.dtype))
            sh = getattr(x, "sharding", None)
            if (
                isinstance(sh, jax.sharding.Sharding)
                and isinstance(k, jax.Array)
                and k.sharding != sh
            ):
                # the target's own layout: jax 0.10's wrap_key_data of key data sharded
                # (..., None) on a one-device mesh keeps that rank-(n+1) spec on the
                # rank-n key, which programs then refuse (the same buffers, re-labelled)
                if k.sharding.device_set == sh.device_set:
                    k = relabeled(k, sh)
                else:
                    k = jax.device_put(k, sh)
            return k
        if isinstance(g, jax.Array) and getattr(x, "weak_type", False):
            return _compat.with_weak_type(g, True)
        return g

    return jax.tree.map(leaf, got, target)


def _empty(x: Any) -> bool:
    """A zero-size array (or target): Orbax refuses to store one; it holds no data, so it
    is saved as an empty node and made again, from the target, on restore."""
    shape = getattr(x, "shape", None)
    return (
        isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))
        and shape is not None
        and 0 in tuple(shape)
    )


def _without_empty(tree: Any) -> Any:
    return jax.tree.map(lambda x: None if _empty(x) else x, tree)


def _made_empty(x: Any) -> Any:
    """The zero-size leaf of target ``x``, in its layout."""
    key = _is_key(x)
    struct = _key_data_struct(x) if key else x
    sharding = getattr(struct, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        out: Any = np.zeros(struct.shape, struct.dtype)
    else:
        out = jax.make_array_from_callback(
            tuple(struct.shape), sharding, lambda idx: np.zeros(struct.shape, struct.dtype)[idx]
        )
    return jax.random.wrap_key_data(out, impl=_compat.key_impl(x.dtype)) if key else out


def _restore_arg(ocp: Any, x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct) and isinstance(x.sharding, jax.sharding.Sharding):
        return ocp.ArrayRestoreArgs(
            sharding=x.sharding, global_shape=tuple(x.shape), dtype=x.dtype, strict=True
        )
    if isinstance(x, str):
        return ocp.RestoreArgs(restore_type=str)
    return ocp.RestoreArgs(restore_type=np.ndarray)


def _handler() -> Any:
    """Orbax's PyTree handler; in multi-process runs with whole-shard writes (no
    replica-parallel slicing), so a process that holds no shard of an array records the
    same chunk layout as the one that writes it."""
    ocp = _ocp()
    if jax.process_count() == 1:
        return ocp.PyTreeCheckpointHandler()
    th = ocp.type_handlers
    kinds = [int, float, bytes, np.number, np.ndarray, str, type(ocp.PLACEHOLDER)]
    registry = th.create_type_handler_registry(
        *[(k, th.get_type_handler(k)) for k in kinds if th.has_type_handler(k)],
        (jax.Array, th.ArrayHandler(use_replica_parallel=False)),
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def accept_mpmd_arrays() -> None:
    """Let Orbax save arrays that live entirely on one process's devices (``save`` and
    ``CheckpointManager`` call this; call it yourself before saving MPMD state with your
    own Orbax ``CheckpointManager``, as ``multimesh-run --model maxtext`` does for
    MaxText's).

    In a multi-process run Orbax refuses arrays that are fully addressable on the saving
    process (it takes them for ``pmap``-style host-local arrays). Under MPMD such an array
    is a proper global array whose submesh belongs to one process: that process writes
    its shards and the others, which hold none, write nothing, which is what Orbax's
    writer does once past that check. The check is the only use of ``process_count`` in
    the module, so it sees a one-process view there."""
    if jax.process_count() == 1:
        return
    try:
        from orbax.checkpoint._src.serialization import jax_array_handlers as mod
        from orbax.checkpoint._src.serialization import replica_slices as rs
    except ImportError as e:
        raise ImportError(
            "multi-process MPMD checkpoints need orbax-checkpoint's serialization modules "
            f"(jax_array_handlers, replica_slices), which this Orbax version lacks: {e}"
        ) from e
    if isinstance(mod.jax, _OneProcessView):
        return
    mod.jax = _OneProcessView(jax)
    # an array with no shard on this process: nothing for this process to write; and
    # whole-shard writes only (no replica-parallel slicing), so a process holding none of
    # an array records the same chunk shape as the process that writes it (a caller's
    # own handler, e.g. MaxText's, may ask for replica-parallel writes)
    original = rs.get_replica_slices

    def get_replica_slices(
        arr: Any, replica_id: Any, use_replica_parallel: bool = False, *args: Any, **kwargs: Any
    ) -> Any:
        del use_replica_parallel
        args = (replica_id, False, *args)
        if not arr.addressable_shards:
            return rs.ReplicaSlices(
                global_shape=arr.shape,
                local_shape=arr.sharding.shard_shape(arr.shape),
                sharding=arr.sharding,
                dtype=arr.dtype,
                is_on_host=False,
                replica_slices=[],
            )
        return original(arr, *args, **kwargs)

    rs.get_replica_slices = get_replica_slices


class _OneProcessView:
    """``jax`` with ``process_count() == 1`` (see :func:`accept_mpmd_arrays`)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def process_count(self) -> int:
        return 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _elsewhere(x: Any) -> bool:
    """A leaf whose sharding has no device of this process (multi-process runs)."""
    sh = getattr(x, "sharding", None)
    if jax.process_count() == 1 or not isinstance(sh, jax.sharding.Sharding):
        return False
    me = jax.process_index()
    return all(d.process_index != me for d in sh.device_set)


def _restore(restore_fn: Any, target: Any) -> Any:
    """Restore through Orbax, skipping (``PLACEHOLDER``) the arrays that live entirely
    on other processes (Orbax cannot build arrays with no local shard) and making them
    global arrays without local shards afterwards."""
    ocp = _ocp()
    if any(_empty(x) for x in jax.tree.leaves(target)):
        got = _restore(restore_fn, _without_empty(target))
        return jax.tree.map(
            lambda g, x: _made_empty(x) if _empty(x) else g,
            got,
            target,
            is_leaf=lambda v: v is None,
        )
    abstract = _abstract(target)
    skipped = jax.tree.map(_elsewhere, abstract)
    item = jax.tree.map(lambda x, s: ocp.PLACEHOLDER if s else x, abstract, skipped)
    restore_args = jax.tree.map(
        lambda x, s: ocp.PLACEHOLDER if s else _restore_arg(ocp, x), abstract, skipped
    )
    got = restore_fn(ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
    if not any(jax.tree.leaves(skipped)):
        return _as_target(got, target)
    got = jax.tree.map(
        lambda g, x, s: (
            jax.make_array_from_single_device_arrays(x.shape, x.sharding, [], dtype=x.dtype)
            if s
            else g
        ),
        got,
        abstract,
        skipped,
        is_leaf=lambda v: v is ocp.PLACEHOLDER,
    )
    return _as_target(got, target)


def _meta_tree(meta: Any) -> Any:
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    return tree


def _key_name(k: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _keyed(tree: Any) -> dict[str, Any]:
    """Leaves by path, written the same way for the target and the checkpoint metadata
    (which stores named tuples and dataclasses as dicts)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=_array_like_leaf)
    return {"/".join(_key_name(k) for k in p) or "<root>": x for p, x in leaves}


def _array_like_leaf(x: Any) -> bool:
    """Array-like and not itself a pytree node (a Flax ``Variable`` has a shape and a
    dtype too, but is a node holding its value)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        return False
    return jax.tree_util.all_leaves([x])


def _listed(keys: list[str], limit: int = 12) -> str:
    if len(keys) <= limit:
        return str(keys)
    return f"{keys[:limit]} and {len(keys) - limit} more"


#: the parts of an Orbax (OCDBT) checkpoint without which it lists no arrays
_INDEX_PARTS = ("_METADATA", "manifest.ocdbt", "d")


def _damage(root: Path | None) -> str:
    """What of a checkpoint's index is missing or empty under ``root`` (for errors)."""
    if root is None or not root.is_dir():
        return ""
    gone = [
        n
        for n in _INDEX_PARTS
        if not (root / n).exists()
        or ((root / n).is_dir() and not any((root / n).iterdir()))
        or ((root / n).is_file() and (root / n).stat().st_size == 0)
    ]
    if not gone:
        return " (its index files are present: one may be cut short or damaged)"
    return f" ({', '.join(gone)} missing or empty in {root})"


def check_compatible(meta: Any, target: Any, where: str, root: Path | None = None) -> None:
    """Raise ``ValueError`` naming every key that differs between a checkpoint's
    metadata and the target (missing, extra, shape, dtype). ``root``: the checkpoint's
    folder, to say what is damaged when it lists nothing."""
    saved = _keyed(_meta_tree(meta))
    want = _keyed(_abstract(_without_empty(target)))  # zero-size leaves are not stored
    if want and not saved:
        raise ValueError(
            f"checkpoint {where} is unreadable or corrupt: it lists no arrays{_damage(root)}"
        )
    missing = sorted(set(want) - set(saved))
    extra = sorted(set(saved) - set(want))
    wrong = []
    for k in sorted(set(saved) & set(want)):
        s, w = saved[k], want[k]
        s_arr, w_arr = hasattr(s, "shape"), hasattr(w, "shape")
        if not (s_arr and w_arr):  # a string (or other non-array) leaf
            if s_arr != w_arr:
                have = "an array" if s_arr else "a non-array value (a string?)"
                wanted = "an array" if w_arr else f"a {type(w).__name__}"
                wrong.append(f"{k}: {have} in the checkpoint, {wanted} wanted")
            continue
        if tuple(s.shape) != tuple(w.shape):
            wrong.append(f"{k}: shape {tuple(s.shape)} in the checkpoint, {tuple(w.shape)} wanted")
        elif np.dtype(s.dtype) != np.dtype(w.dtype):
            wrong.append(
                f"{k}: dtype {np.dtype(s.dtype)} in the checkpoint, {np.dtype(w.dtype)} wanted"
            )
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_listed(missing)}")
        if extra:
            parts.append(f"in the checkpoint but not in the target: {_listed(extra)}")
        parts += wrong[:12] + ([f"and {len(wrong) - 12} more"] if len(wrong) > 12 else [])
        raise ValueError(f"checkpoint {where} does not match the target: " + "; ".join(parts))


#: what makes a restore fail after the keys, shapes and dtypes matched
_WHY = (
    " (containers of other kinds than the checkpoint's, e.g. a list saved and a dict "
    "wanted; a sharding that does not divide an array; or a damaged checkpoint)"
)


def save(
    path: str | os.PathLike, state: Any, *, step: int | None = None, force: bool = False
) -> None:
    """Write ``state`` to ``path`` (a new directory) and wait until it is complete.

    Every process must call it (as with any multi-process save). ``step`` is recorded in
    the checkpoint's metadata. ``force=True`` replaces an existing checkpoint."""
    _check_has_leaves(state, "mm.checkpoint.save")
    ocp = _ocp()
    path = Path(path).absolute()
    accept_mpmd_arrays()
    if jax.process_count() > 1:
        _agree(path, state, f"mm.checkpoint.save({str(path)!r})")
    with ocp.Checkpointer(_handler()) as ck:
        ck.save(
            path,
            args=ocp.args.PyTreeSave(_without_empty(state)),
            force=force,
            custom_metadata={"step": step},
        )


#: multi-process saves this process has started (numbers their host exchanges: every
#: process makes the same saves in the same order)
_SAVES = itertools.count(1)


def _agree(path: Path, state: Any, what: str, step: int | None = None) -> None:
    """Multi-process: every process reaches this save (a process that skips it, e.g.
    behind ``if jax.process_index() == 0``, or exits, is a clear error instead of a
    hang), with the same path and step, and with the same values in the leaves that are
    not global arrays (host values, uncommitted arrays, arrays on one process's own
    devices: a checkpoint keeps one copy of them, so a value that differs per process
    would come back as another's)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    local: dict[str, str] = {}
    for keypath, x in leaves:
        if _process_local(x):
            local[jax.tree_util.keystr(keypath)] = _digest(x)
        elif isinstance(x, jax.Array) and x.is_fully_addressable:
            # on this process's devices only: the same devices on every process (an
            # mm.jit output there) is one global array; other devices, one per process
            local[jax.tree_util.keystr(keypath)] = "on " + str(
                sorted(int(d.id) for d in x.sharding.device_set)
            )
    mine = json.dumps({"path": str(path), "step": step, "local": local}, sort_keys=True)
    key = f"multimesh/checkpoint/{next(_SAVES)}"
    theirs = crossproc.exchange_with_all(key, mine, what)
    for p, raw in sorted(theirs.items()):
        got = json.loads(raw)
        if got["path"] != str(path):
            raise ValueError(
                f"{what}: process {p} saves to {got['path']} at the same point; a "
                "checkpoint is one directory all processes write together: save to the "
                "same path on every process."
            )
        if got["step"] != step:
            raise ValueError(
                f"{what}: process {p} saves step {got['step']} at the same point; every "
                "process must save the same steps."
            )
        differ = sorted(k for k, d in got["local"].items() if local.get(k) not in (None, d))
        if differ:
            raise ValueError(
                f"{what}: {', '.join(differ)} hold values of each process only (host "
                "values, uncommitted arrays or arrays on a process's own devices, not "
                f"global arrays) that differ between this process and process {p}; a "
                "checkpoint keeps one copy of each. Save the same value on every "
                "process, or make it a global array (e.g. an mm.jit output)."
            )


def _process_local(x: Any) -> bool:
    if isinstance(x, jax.Array):
        return not getattr(x, "committed", True) and x.is_fully_addressable
    return isinstance(x, (np.ndarray, np.generic, int, float, complex, bool, str, bytes))


def _digest(x: Any) -> str:
    if isinstance(x, (str, bytes)):
        return hashlib.sha256(x.encode() if isinstance(x, str) else x).hexdigest()[:32]
    is_key = isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    a = np.asarray(jax.random.key_data(x) if is_key else x)
    return hashlib.sha256(f"{a.dtype}{a.shape}".encode() + a.tobytes()).hexdigest()[:32]


def _check_has_leaves(state: Any, what: str) -> None:
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    if not leaves:
        raise ValueError(
            f"{what}: the state has no values ({type(state).__name__} with no leaves: None "
            "or an empty pytree); there is nothing to save. Pass the pytree of arrays to "
            "keep (e.g. (params, opt_state))."
        )
    gone = [
        jax.tree_util.keystr(k) or "the state"
        for k, x in leaves
        if isinstance(x, jax.Array) and x.is_deleted()
    ]
    if gone:
        more = f" and {len(gone) - 12} more" if len(gone) > 12 else ""
        raise ValueError(
            f"{what}: {', '.join(gone[:12])}{more} "
            f"{'has' if len(gone) == 1 else 'have'} been deleted "
            "(donated to a jitted call, or deleted by hand): save the arrays that call "
            "returned instead."
        )


def _check_count(name: str, value: Any, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"CheckpointManager({name}={value!r}): give an integer >= 1"
            + (" (None keeps every step)." if none_ok else ".")
        )


def restore(path: str | os.PathLike, target: Any) -> Any:
    """Read the checkpoint at ``path`` into the layout of ``target`` (see the module
    docstring); every process reads only the shards of its own devices."""
    ocp = _ocp()
    path = Path(path).absolute()
    if not path.exists():
        raise FileNotFoundError(
            f"no checkpoint at {path} (an interrupted save leaves none: use "
            "CheckpointManager to restore the latest complete step)"
        )
    quiet = contextlib.nullcontext()
    if not (path / "_METADATA").exists() and (path / "default" / "_METADATA").exists():
        path = path / "default"  # a CheckpointManager step (multimesh-run writes these)
        quiet = _without_orbax_notice(str(path / "_CHECKPOINT_METADATA"))
    elif not (path / "_METADATA").exists() and (steps := saved_steps(path)):
        raise ValueError(
            f"{path} is a CheckpointManager directory (steps {steps}), not one "
            f"checkpoint: restore a step ({path}/STEP) or use CheckpointManager(...).restore"
        )
    with quiet, ocp.Checkpointer(_handler()) as ck:
        try:
            meta = ck.metadata(path)
        except Exception as e:  # noqa: BLE001 - Orbax raises many kinds
            raise ValueError(f"checkpoint {path} is unreadable or corrupt: {e}") from e
        check_compatible(meta, target, str(path), path)
        try:
            return _restore(lambda args: ck.restore(path, args=args), target)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"checkpoint {path} could not be restored into the target{_WHY}: {e}") from e


@contextlib.contextmanager
def _without_orbax_notice(missing: str) -> Any:
    """Drop Orbax's "Metadata file does not exist: <missing>" log line: a manager step's
    metadata file sits beside its ``default`` folder, which is read as one checkpoint."""

    def keep(record: logging.LogRecord) -> bool:
        return missing not in record.getMessage()

    log = logging.getLogger("absl")
    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


def _step_number(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"a checkpoint step must be an int, got {step!r}")
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    return int(step)


#: files an Orbax step directory holds (any one is enough)
_STEP_MARKERS = ("_CHECKPOINT_METADATA", "commit_success.txt", "_METADATA")


def _is_step(p: Path) -> bool:
    return any((p / m).exists() for m in _STEP_MARKERS) or any(
        (q / "_METADATA").exists() for q in p.iterdir() if q.is_dir()
    )


#: files Orbax writes inside a step's item folder (``default``), as paths below it: OCDBT
#: chunks and manifests (per process), array metadata, shardings
_ORBAX_DATA = re.compile(
    r"(ocdbt\.process_\d+/)?(d/[0-9a-f]{32}|manifest\.ocdbt)"
    r"|_sharding|_METADATA|commit_success\.txt|array_metadatas/process_\d+"
)


def _is_remnant(p: Path) -> bool:
    """A numbered folder holding only files of Orbax's layout inside item folders: what
    an in-place deletion a crash interrupted leaves (Orbax's ``rmtree`` removes files in
    listing order). The manager deletes by renaming, so it no longer leaves these; a
    message names them."""
    found = False
    for root, _dirs, files in os.walk(p):
        rel = Path(root).relative_to(p).parts
        for f in files:
            if not rel or not _ORBAX_DATA.fullmatch("/".join((*rel[1:], f))):
                return False
            found = True
    return found


#: where the manager moves a step it deletes (pruning, ``delete``): one rename, so a
#: crash never leaves a half-deleted step among the steps; emptied when the next save
#: starts, on ``delete``/``wait_until_finished``/``close``, and when a manager opens the
#: directory (not a number: never a step)
_DELETED = ".deleted-steps"


def saved_steps(directory: str | os.PathLike) -> list[int]:
    """The steps a :class:`CheckpointManager` directory holds, read from the file system
    alone (no Orbax, no coordination between processes): e.g. to refuse, before training,
    a run that would write into another run's checkpoints."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit() and _is_step(p))


def foreign_steps(directory: str | os.PathLike) -> list[str]:
    """Integer-named folders in ``directory`` that are not Orbax steps (a
    :class:`CheckpointManager` refuses such a directory)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    out = []
    for p in sorted(directory.iterdir()):
        if p.is_dir() and p.name.isdigit() and not _is_step(p):
            out.append(p.name)
    return out


class CheckpointManager:
    """Numbered checkpoints in ``directory``: asynchronous saves, the latest complete
    step on restore, old steps pruned (``max_to_keep``: the newest that many complete
    steps stay; ``None`` keeps all). With ``save_interval_steps=N`` a save happens for the
    first step saved into an empty directory, then for multiples of ``N`` (Orbax's rule);
    ``save`` returns whether it saved. A save a crash interrupted is not
    a step (the manager goes on from the newest complete one); steps are deleted (pruning,
    ``delete``) by moving them aside in one rename, then removing them."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ) -> None:
        _check_count("max_to_keep", max_to_keep, none_ok=True)
        _check_count("save_interval_steps", save_interval_steps)
        ocp = _ocp()
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            # Orbax would fail in its background thread and a wait would never end
            raise NotADirectoryError(
                f"{self.directory} is a file, not a directory: give CheckpointManager a "
                "directory of its own for checkpoints"
            )
        if any((self.directory / m).exists() for m in ("_METADATA", "_CHECKPOINT_METADATA")):
            raise ValueError(  # steps would be written beside it, and it would never restore
                f"{self.directory} is one checkpoint (as mm.checkpoint.save writes), not a "
                "directory of numbered steps: read it with mm.checkpoint.restore, and give "
                "CheckpointManager a directory of its own."
            )
        foreign = foreign_steps(self.directory)
        if foreign:
            partial = [f for f in foreign if _is_remnant(self.directory / f)]
            raise ValueError(
                f"{self.directory} holds numbered folders that are not checkpoints "
                f"({_listed(foreign)}): the manager would take them for steps (and delete "
                "them when pruning). Use a directory of its own for checkpoints."
                + (
                    f" {_listed(partial)} hold only Orbax data files, as a deletion that "
                    "a crash interrupted leaves them (no longer by this manager, which "
                    "deletes by renaming): they cannot be restored; delete them."
                    if partial
                    else ""
                )
            )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
            todelete_subdir=_DELETED,
        )
        self._ocp = ocp
        self._closed = False
        self._purge()
        # the handler is named up front, so a new process can read existing steps' metadata
        self._m = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handler())

    def _purge(self) -> None:
        """Remove the steps moved aside (the first process only: Orbax's deleter runs
        there). Step by step, never the folder itself: a save in flight may be moving
        another step into it (one rename: what is there is whole)."""
        if jax.process_index() == 0 and (self.directory / _DELETED).is_dir():
            for p in (self.directory / _DELETED).iterdir():
                shutil.rmtree(p, ignore_errors=True)

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Start saving ``state`` as ``step`` (returns at once when asynchronous; the
        arrays are copied first, so training may go on and donate them). Returns
        whether a save happened: not for steps ``save_interval_steps`` skips, nor for a
        step already saved (a final save after the loop's last one; its old values stay:
        ``delete(step)`` first to replace them)."""
        step = _step_number(step)
        self._check_open(f"save({step})")
        _check_has_leaves(state, "CheckpointManager.save")
        latest = self._m.latest_step()
        if latest is not None and step < latest:
            # Orbax's steps: the complete ones and one still being saved
            later = sorted({int(s) for s in self._m.all_steps() if int(s) > step})
            raise ValueError(
                f"step {step} is older than the latest checkpoint in {self.directory} "
                f"(step {latest}): Orbax keeps steps in order and would drop this save. To "
                f"go on from an earlier step, delete the later ones first "
                f"(manager.delete(step) for each of {later}) or save to another directory."
            )
        if force and (step == latest or step in self.all_steps()):
            raise ValueError(  # Orbax's own error does not say what to do
                f"step {step} already has a checkpoint in {self.directory}; force=True does "
                f"not replace it: delete it first (manager.delete({step}))."
            )
        accept_mpmd_arrays()
        if jax.process_count() > 1:
            self._settle(state, step)
        self._purge()  # what earlier saves' pruning moved aside
        return bool(
            self._m.save(step, args=self._ocp.args.PyTreeSave(_without_empty(state)), force=force)
        )

    def delete(self, step: int) -> None:
        """Delete the checkpoint of ``step`` (e.g. steps after the one a run went back
        to)."""
        self._check_open(f"delete({step})")
        self.wait_until_finished()
        self._m.delete(_step_number(step))
        self._purge()

    def _settle(self, state: Any, step: int) -> None:
        """Multi-process: wait until every process's ``state`` is computed, with a host
        barrier (the coordination service), before Orbax's own barrier, which is a
        device collective: started while another process still pulls this step's
        values from here, it can take the devices those pulls need and hang both
        (seen on CPU: one process in the collective, the other waiting for its step)."""
        jax.block_until_ready([x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)])
        _agree(self.directory, state, f"CheckpointManager.save({step})", step=step)

    def latest_step(self) -> int | None:
        """The newest complete step (interrupted saves, and saves still in flight, are
        not steps)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> Sequence[int]:
        """The complete steps, oldest first, read from disk: Orbax's own list forgets a
        step it will prune as soon as the save that replaces it starts (while that step
        is still the newest complete one) and keeps a step whose deletion a crash
        interrupted."""
        return saved_steps(self.directory)

    def restore(self, step: int | None = None, *, target: Any) -> Any:
        """Read ``step`` (default: the latest complete one) into ``target``'s layout."""
        self.wait_until_finished()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        elif _step_number(step) not in self.all_steps():
            raise FileNotFoundError(
                f"no complete checkpoint for step {step} in {self.directory} "
                f"(complete steps: {self.all_steps()})"
            )
        where = f"{self.directory} step {step}"
        earlier = [s for s in self.all_steps() if s < _step_number(step)]

        def hint(damaged: bool) -> str:  # the earlier steps, for a damaged one
            if not earlier:
                return ""
            how = f"restore one with restore(step={earlier[-1]}, target=...)"
            if damaged:
                return f" Earlier complete steps: {earlier}; {how}."
            return f" If this step is damaged, earlier complete steps: {earlier}; {how}."

        def sentence(e: Any) -> str:
            text = str(e).rstrip()
            return text if text.endswith((".", "!", "?")) else text + "."

        try:
            meta = self._m.item_metadata(step)
        except Exception as e:  # noqa: BLE001
            raise ValueError(
                sentence(f"checkpoint {where} is unreadable or corrupt: {e}") + hint(True)
            ) from e
        try:
            check_compatible(meta, target, where, self.directory / str(step) / "default")
        except ValueError as e:
            if "unreadable or corrupt" in str(e) and earlier:
                raise ValueError(sentence(e) + hint(True)) from e
            raise
        try:
            return _restore(lambda args: self._m.restore(step, args=args), target)
        except Exception as e:  # noqa: BLE001
            raise ValueError(
                sentence(f"checkpoint {where} could not be restored into the target{_WHY}: {e}")
                + hint(False)
            ) from e

    def wait_until_finished(self) -> None:
        """Block until pending asynchronous saves are complete."""
        self._m.wait_until_finished()
        self._purge()

    def close(self) -> None:
        """Wait for the save in flight and stop the manager's threads; it can still
        restore and list steps, not save or delete."""
        self._closed = True
        self._m.close()
        self._purge()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"CheckpointManager({str(self.directory)!r}).{what}: the manager is closed "
                "(its `with` block ended, or close() was called); open a new one for the "
                "directory."
            )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
