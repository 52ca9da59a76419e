"""Tasks: regions of a program that run on one submesh.

``with mm.task("embed", stage=0): ...`` marks everything traced inside (and, through
JAX's name stacks, its gradient) as belonging to submesh 0. A task is a
``jax.named_scope`` whose name carries a reserved marker (``<name>@mm:s<stage>`` or
``<name>@mm:m<mesh id>``); no custom primitive is needed, so tasks survive ``grad``,
``vmap``, ``checkpoint`` and Flax. Outside ``mm.jit`` a task is transparent: the
program runs as ordinary JAX, with or without an active MultiMesh. While ``mm.jit``
traces, shardings inside a task refer to the mesh the reference sees (the global mesh,
or the task's ``mesh=``); the compiler rewrites them to the task's submesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar, overload

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from multimesh import _compat
from multimesh.mesh import MultiMesh, active_multimesh

_compat.register_exclusion(__file__)

F = TypeVar("F", bound=Callable[..., Any])

MARKER = "@mm:"
_MARKER_RE = re.compile(r"^(?P<name>.*)@mm:(?P<kind>[sml])(?P<idx>\d+)$")

# Interning table for explicit task meshes: a marker must be self-describing, because JAX
# may reuse a jaxpr traced earlier (e.g. a cached nested jit).
_MESH_LOCK = threading.Lock()
_MESH_IDS: dict[Mesh, int] = {}
_MESHES: list[Mesh] = []


def _mesh_id(mesh: Mesh) -> int:
    with _MESH_LOCK:
        if mesh not in _MESH_IDS:
            _MESH_IDS[mesh] = len(_MESHES)
            _MESHES.append(mesh)
        return _MESH_IDS[mesh]


@dataclasses.dataclass(frozen=True)
class ByLayer:
    """Stages by layer: the stage of each iteration of a ``scan`` over stacked layers.

    ``mm.by_layer()`` splits the layers evenly and contiguously over the submeshes;
    ``mm.by_layer(lambda i, n: ...)`` gives layer ``i`` of ``n`` its (virtual) stage.
    Use it as a task's ``stage`` inside the scanned body, or as a ``task_rules`` value
    for a scope inside the body: ``mm.jit`` then splits the scan (and its backward)
    into one scan per run of consecutive layers on the same stage.
    """

    fn: Callable[[int, int], int] | None = None

    def stages(self, num_layers: int, num_stages: int) -> list[int]:
        out = []
        for i in range(num_layers):
            s = self.fn(i, num_layers) if self.fn is not None else i * num_stages // num_layers
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
                raise TypeError(f"mm.by_layer: the stage of layer {i} must be an int, got {s!r}.")
            out.append(int(s))
        return out


def by_layer(fn: Callable[[int, int], int] | None = None) -> ByLayer:
    """Stages per layer for a ``scan`` over stacked layers (see :class:`ByLayer`)."""
    if fn is not None and not callable(fn):
        raise TypeError(f"mm.by_layer takes a callable (layer, num_layers) -> stage, got {fn!r}.")
    return ByLayer(fn)


_LAYER_IDS: dict[ByLayer, int] = {}
_LAYERS: list[ByLayer] = []


def _layer_id(spec: ByLayer) -> int:
    with _MESH_LOCK:
        if spec not in _LAYER_IDS:
            _LAYER_IDS[spec] = len(_LAYERS)
            _LAYERS.append(spec)
        return _LAYER_IDS[spec]


@dataclasses.dataclass(frozen=True)
class TaskRef:
    """A task as recorded in a name stack: its name and either a stage, a mesh, or
    stages by layer (for a scan over layers, split by the compiler)."""

    name: str
    stage: int | None
    mesh: Mesh | None
    layers: ByLayer | None = None


def decode_marker(scope: str) -> TaskRef | None:
    """Parse a named-scope string; ``None`` if it is not a task marker."""
    if MARKER not in scope:
        return None
    m = _MARKER_RE.match(scope)
    if m is None:
        return None
    idx = int(m["idx"])
    if m["kind"] == "s":
        return TaskRef(m["name"], idx, None)
    if m["kind"] == "l":
        return TaskRef(m["name"], None, None, _LAYERS[idx])
    return TaskRef(m["name"], None, _MESHES[idx])


@dataclasses.dataclass
class LoopInfo:
    """A microbatch loop traced (unrolled) inside ``mm.jit``."""

    schedule: Any
    num_microbatches: int


@dataclasses.dataclass
class TraceState:
    """Set while ``mm.jit`` traces a program."""

    multimesh: MultiMesh | None
    loops: list[LoopInfo] = dataclasses.field(default_factory=list)

    def add_loop(self, schedule: Any, num_microbatches: int) -> int:
        self.loops.append(LoopInfo(schedule, num_microbatches))
        return len(self.loops) - 1


_TRACE: contextvars.ContextVar[TraceState | None] = contextvars.ContextVar(
    "multimesh_trace", default=None
)
_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "multimesh_task", default=None
)


def trace_state() -> TraceState | None:
    return _TRACE.get()


# Virtual stages (interleaving) allowed while a microbatch loop with such a schedule runs.
_VIRTUAL: contextvars.ContextVar[Any] = contextvars.ContextVar("multimesh_virtual", default=None)


@contextlib.contextmanager
def stage_limit(schedule: Any):
    """Inside an interleaved microbatch loop, tasks may use virtual stages >= num_stages."""
    tok = _VIRTUAL.set(schedule)
    try:
        yield
    finally:
        _VIRTUAL.reset(tok)


@contextlib.contextmanager
def tracing(state: TraceState):
    tok = _TRACE.set(state)
    try:
        yield state
    finally:
        _TRACE.reset(tok)


def check_mesh(mesh: Any, name: str, mmesh: MultiMesh | None, traced: bool) -> Mesh:
    """A task's ``mesh=``: a Mesh always; under ``mm.jit`` (``traced``) also one MultiMesh
    can run (Auto axes, its devices). Outside it the task is a named scope only."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"task {name!r}: mesh= must be a jax.sharding.Mesh, got {type(mesh).__name__}."
        )
    if not traced:
        return mesh
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        raise ValueError(
            f"task {name!r}: its mesh has Explicit axes; MultiMesh supports Auto axes. Build "
            "it with jax.sharding.Mesh(devices, names, axis_types=(AxisType.Auto,) * ndim)."
        )
    if mmesh is not None:
        known = set(mmesh.devices)  # devices, not ids: ids repeat across platforms
        foreign = [d for d in mesh.devices.flat if d not in known]
        if foreign:
            raise ValueError(
                f"task {name!r}: its mesh uses devices {foreign} that are not in the "
                f"MultiMesh {mmesh}; use devices of that MultiMesh (or pass no mesh= to mm.jit)."
            )
    return mesh


def resolve(name: str, stage: Any, mesh: Any) -> tuple[str, Mesh | None]:
    """Validate a task's arguments; return its marker scope name and its submesh.

    Outside ``mm.jit`` with no active MultiMesh the submesh is ``None``: the task is
    only a named scope (tasks are transparent)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a task name must be a non-empty str, got {name!r}.")
    if MARKER in name:
        raise ValueError(f"task name {name!r} must not contain {MARKER!r}.")
    if (stage is None) == (mesh is None):
        raise ValueError(
            f"task {name!r}: give exactly one of stage= (an index into the active MultiMesh) "
            f"or mesh= (a jax.sharding.Mesh); got stage={stage!r}, mesh={mesh!r}."
        )
    state = trace_state()
    mmesh = state.multimesh if state is not None and state.multimesh else active_multimesh()
    if mesh is not None:
        mesh = check_mesh(mesh, name, mmesh, traced=state is not None)
        return f"{name}{MARKER}m{_mesh_id(mesh)}", mesh
    if isinstance(stage, ByLayer):  # placed per layer when mm.jit splits the scan
        return f"{name}{MARKER}l{_layer_id(stage)}", None
    if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)):
        raise TypeError(f"task {name!r}: stage must be an int, got {stage!r}.")
    stage = int(stage)
    if stage < 0:
        raise ValueError(f"task {name!r}: stage={stage} is out of range; stages start at 0.")
    if mmesh is None:
        if state is not None:
            raise ValueError(
                f"task {name!r}: stage={stage} needs a MultiMesh under mm.jit; pass "
                "mesh=mmesh to mm.jit, or call it inside `with mmesh:`."
            )
        return f"{name}{MARKER}s{stage}", None  # transparent: a named scope only
    sched = _VIRTUAL.get()
    if state is not None and sched is not None:
        # inside an interleaved loop: its virtual stages. Elsewhere under mm.jit (code
        # before or after such a loop: initialisation, evaluation of the same model) the
        # labelling pass checks once the whole program is traced, against the largest
        # loop's virtual stages; outside mm.jit a task is transparent: virtual stage i is
        # on submesh i % num_stages
        limit = mmesh.num_stages * sched.chunks(mmesh.num_stages, 1 << 30)
        check_stage_range(name, stage, mmesh.num_stages, limit)
    return f"{name}{MARKER}s{stage}", mmesh.submesh(stage % mmesh.num_stages)


def check_stage_range(name: str, stage: int, num_stages: int, limit: int) -> None:
    """Raise a clear error if ``stage`` is not a valid (virtual) stage."""
    if 0 <= stage < limit:
        return
    hint = (
        f"valid: 0..{limit - 1} ({limit // num_stages} virtual stages per submesh)"
        if limit > num_stages
        else f"valid: 0..{num_stages - 1}; more stages than submeshes need an interleaved "
        "schedule with as many chunks per submesh (e.g. Interleaved1F1B() without num_chunks), "
        f"and in a program without such a loop (init, evaluation on their own) the submesh "
        f"itself: stage % {num_stages}"
    )
    raise ValueError(
        f"task {name!r}: stage={stage} is out of range; the MultiMesh has "
        f"{num_stages} stages ({hint})."
    )


class _Task:
    """Context manager (and decorator) placing traced code on one submesh."""

    def __init__(
        self,
        name: str | None,
        stage: int | None,
        mesh: Mesh | None,
        logical_axis_rules: Any = None,
    ) -> None:
        self.name, self.stage, self.mesh = name, stage, mesh
        self.logical_axis_rules = _check_rules(name, logical_axis_rules)
        # per-thread stack of open entries: one task object may be entered by several
        # threads at once (e.g. a decorated function traced concurrently)
        self._local = threading.local()

    def __enter__(self) -> _Task:
        if self.name is None:
            raise TypeError(
                "mm.task needs a name when used as a context manager: "
                "with mm.task('name', stage=...):"
            )
        outer = _CURRENT.get()
        if outer is not None:
            raise ValueError(
                f"task {self.name!r} is nested inside task {outer!r}; tasks cannot nest. "
                "Close the outer task first, or merge the two into one task."
            )
        scope, submesh = resolve(self.name, self.stage, self.mesh)
        manual = _compat.manual_axes() if trace_state() is not None else ()
        if manual:
            raise ValueError(
                f"task {self.name!r} is inside a shard_map body (manual axes {manual}): "
                "there the code runs per device, and a task places whole arrays on a "
                "submesh. Put the shard_map inside the task instead "
                f"(with mm.task({self.name!r}, ...): jax.shard_map(...)), one per task."
            )
        es = contextlib.ExitStack()
        es.enter_context(jax.named_scope(scope))
        state = trace_state()
        if state is not None and submesh is not None:
            # Shardings traced inside the task refer to the mesh the reference sees (the
            # global mesh for stage= tasks, the task's mesh for mesh= tasks); the
            # compiler rewrites them to the fragment's submesh.
            ctx = self.mesh if self.mesh is not None else None
            mm_ = state.multimesh
            if mm_ is not None and (ctx is None or _is_submesh(ctx, mm_)):
                # (a mesh= task on a submesh reads the global mesh as stage= tasks do, as
                # the reference `with mmesh: jax.jit(f)` does: JAX transposes a shard_map
                # in it outside the task, under the global mesh)
                ctx = mm_.mesh
            es.enter_context(_compat.use_abstract_mesh((ctx or submesh).abstract_mesh))
        if self.logical_axis_rules is not None:
            from flax import linen as nn  # logical names as Flax (Linen and NNX) resolve them

            es.enter_context(nn.logical_axis_rules(self.logical_axis_rules))
        tok = _CURRENT.set(self.name)
        self._local.__dict__.setdefault("stack", []).append((es, tok))
        return self

    def __exit__(self, *exc: Any) -> None:
        es, tok = self._local.stack.pop()
        _CURRENT.reset(tok)
        es.__exit__(*exc)

    def __call__(self, fn: F) -> F:
        if self.name is None:  # @mm.task(stage=1): the task takes the function's name
            name = getattr(fn, "__name__", None) or "task"
            return _Task(name, self.stage, self.mesh, self.logical_axis_rules)(fn)

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapped  # type: ignore[return-value]


def _is_submesh(mesh: Mesh, mmesh: MultiMesh) -> bool:
    """``mesh`` is one of ``mmesh``'s submeshes (same devices, axes and types)."""
    return any(mesh == mmesh.submesh(i) for i in range(mmesh.num_stages))


def _check_rules(name: str | None, rules: Any) -> Any:
    if rules is None:
        return None
    try:
        rules = tuple((str(k), v) for k, v in rules)
    except (TypeError, ValueError):
        raise TypeError(
            f"task {name!r}: logical_axis_rules must be pairs (logical name, mesh axis or "
            f"axes or None), as for flax.linen.logical_axis_rules; got {rules!r}."
        ) from None
    return rules


@overload
def task(
    name: str,
    *,
    stage: int | None = None,
    mesh: Mesh | None = None,
    logical_axis_rules: Any = None,
) -> _Task: ...
@overload
def task(
    fn: F,
    *,
    name: str | None = None,
    stage: int | None = None,
    mesh: Mesh | None = None,
    logical_axis_rules: Any = None,
) -> F: ...
@overload
def task(
    *,
    name: str | None = None,
    stage: int | None = None,
    mesh: Mesh | None = None,
    logical_axis_rules: Any = None,
) -> _Task: ...


def task(
    name_or_fn: Any = None,
    *,
    name: str | None = None,
    stage: int | None = None,
    mesh: Mesh | None = None,
    logical_axis_rules: Any = None,
) -> Any:
    """Place code (and its gradient) on one submesh.

    ``with mm.task("embed", stage=0): ...`` or ``mm.task(fn, stage=0)``. Give exactly
    one of ``stage`` (an index into the active MultiMesh) or ``mesh`` (a
    ``jax.sharding.Mesh`` whose devices belong to the program). As a decorator without
    a name (``@mm.task(stage=1)``) the task takes the function's name. Outside
    ``mm.jit`` a task is transparent: only a named scope, so the function runs as plain
    JAX anywhere (eagerly, under ``jax.jit`` on one device, under ``grad``/``vmap``).

    ``logical_axis_rules`` (pairs ``(logical name, mesh axes)``, as for
    ``flax.linen.logical_axis_rules``) resolve logical axis names inside this task (Flax
    ``nn.with_logical_constraint``, ``with_logical_partitioning``, NNX sharding names),
    so one model written with logical names runs on submeshes with different physical
    layouts. They apply wherever the task runs, the reference included.
    """
    if callable(name_or_fn) and not isinstance(name_or_fn, str):
        fn = name_or_fn
        tname = name or getattr(fn, "__name__", None) or "task"
        if (stage is None) == (mesh is None):
            raise ValueError(
                f"task {tname!r}: give exactly one of stage= or mesh=; "
                f"got stage={stage!r}, mesh={mesh!r}."
            )
        return _Task(tname, stage, mesh, logical_axis_rules)(fn)
    if name_or_fn is not None and name is not None:
        raise TypeError("give the task name once: mm.task('name', ...) or mm.task(name='name').")
    tname = name_or_fn if name_or_fn is not None else name
    if (stage is None) == (mesh is None):
        raise ValueError(
            f"task {tname!r}: give exactly one of stage= or mesh=; "
            f"got stage={stage!r}, mesh={mesh!r}."
        )
    return _Task(tname, stage, mesh, logical_axis_rules)
