"""``multimesh-run --model maxtext``: unmodified MaxText 0.2.5 through its own train loop
(``maxtext.trainers.pre_train.train.main``), pipelined over MultiMesh submeshes.

MaxText's files are never edited. While :func:`hooks` is active, five of its attributes
are replaced at run time (and restored on exit):

- ``maxtext.utils.maxtext_utils.get_mesh_from_config``: MaxText gets the global mesh of
  an ``mm.make_mesh`` MultiMesh whose MPMD axis (``pipeline``, size ``--pp``) comes
  first, followed by MaxText's own axes (``data``, ``stage``, ``fsdp``, ``tensor``, ...)
  sized per stage. MaxText's own ``stage`` axis keeps size 1, so its sharding rules that
  name it (batch sharding, ``['layers', 'stage']``) mean nothing inside a task.
- ``maxtext.models.models.Transformer.__init__``: after construction, ``token_embedder``
  is placed on stage 0, ``decoder.layers_{i}`` on stage ``i * pp * interleave //
  num_layers`` and ``decoder.decoder_norm`` / ``decoder.logits_dense`` on the last one
  (``mm.flax.task``; needs ``scan_layers=False``).
- ``maxtext.utils.train_utils.jit_train_step``: returns ``mm.jit`` of MaxText's
  functional train step (its ``lower().compile()``, ``memory_analysis()`` and calls under
  ``jax.set_mesh`` work unchanged); the new state stays on the stages that own it, and
  MaxText's initial state (replicated over the stages) is first copied to its owners, so
  one compiled program serves every step.
- ``maxtext.trainers.pre_train.train.gradient_accumulation_loss_and_grad``: MaxText's
  ``lax.scan`` gradient accumulation becomes ``mm.microbatch`` with the same microbatches,
  loss normalisation and gradient scaling, ordered by ``--schedule``.
- ``maxtext.trainers.pre_train.train.training_loop_iteration``: wrapped to record each
  step's loss and time (progress bar, summary, ``--metrics``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

from multimesh import _compat

_compat.register_exclusion(__file__)

SUPPORTED_VERSION = "0.2.5"
MPMD_AXIS = "pipeline"  # MaxText's mesh already has a "stage" axis

TRAIN = "maxtext.trainers.pre_train.train"
TRAIN_UTILS = "maxtext.utils.train_utils"
MAXTEXT_UTILS = "maxtext.utils.maxtext_utils"
MODELS = "maxtext.models.models"

HOOK_POINTS: tuple[tuple[str, str], ...] = (
    (TRAIN, "main"),
    (TRAIN, "training_loop_iteration"),
    (TRAIN, "gradient_accumulation_loss_and_grad"),
    (TRAIN_UTILS, "jit_train_step"),
    (MAXTEXT_UTILS, "get_mesh_from_config"),
    (MAXTEXT_UTILS, "get_functional_train_with_signature"),
    (MAXTEXT_UTILS, "calculate_tflops_training_per_device"),
    (MODELS, "Transformer"),
)


class HookError(RuntimeError):
    """A MaxText attribute that ``--model maxtext`` patches is missing."""


def maxtext_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("maxtext")
    except metadata.PackageNotFoundError:
        return "not installed"


def check_hooks() -> None:
    """Raise :class:`HookError` naming the first hook point that this MaxText lacks."""
    for mod, attr in HOOK_POINTS:
        try:
            obj = importlib.import_module(mod)
        except ImportError as e:
            raise HookError(
                f"multimesh-run --model maxtext: cannot import {mod} (hook point {mod}.{attr}) "
                f"from maxtext {maxtext_version()}: {e}. Install it with "
                f"pip install 'multimesh[maxtext]' (MaxText {SUPPORTED_VERSION}, Python >= 3.12)."
            ) from e
        if not hasattr(obj, attr):
            raise HookError(
                f"multimesh-run --model maxtext: hook point {mod}.{attr} is missing in maxtext "
                f"{maxtext_version()}; this integration supports MaxText {SUPPORTED_VERSION}."
            )


# --- configuration ---------------------------------------------------------------------


def base_config() -> str:
    """MaxText's ``configs/base.yml`` inside the installed package."""
    import maxtext

    return str(Path(maxtext.__file__).parent / "configs" / "base.yml")


def per_device_batch(ns: argparse.Namespace, num_devices: int) -> float:
    """MaxText's ``per_device_batch_size`` (per microbatch) for a global ``--batch-size``."""
    m = ns.num_microbatches
    pdbs = ns.batch_size / (num_devices * m)
    if int(pdbs * num_devices) * m != ns.batch_size:
        raise ValueError(
            f"--batch-size {ns.batch_size} / --num-microbatches {m} is not a whole number of "
            f"rows per device fraction MaxText accepts on {num_devices} devices"
        )
    return int(pdbs) if pdbs == int(pdbs) else pdbs


def overrides(
    ns: argparse.Namespace, *, run_name: str, output_dir: str, pipelined: bool
) -> dict[str, Any]:
    """MaxText ``key=value`` settings for these flags. ``pipelined=False``: the unpipelined
    reference (MaxText's own mesh, the ``--pp`` devices folded into data parallelism)."""
    ndev = jax.device_count()
    o: dict[str, Any] = {
        "run_name": run_name,
        "base_output_directory": output_dir,
        "hardware": ns.backend,
        # multimesh.distributed.initialize() already joined any multi-process job
        "skip_jax_distributed_system": True,
        "dataset_type": "synthetic",
        # MaxText's own checkpointing (orbax) under --checkpoint-dir; never for the reference
        "enable_checkpointing": bool(ns.checkpoint_dir) and pipelined,
        "steps": ns.num_steps,
        "scan_layers": False,
        "max_target_length": ns.sequence_length,
        "per_device_batch_size": per_device_batch(ns, ndev),
        "gradient_accumulation_steps": ns.num_microbatches,
        "learning_rate": ns.learning_rate,
        "init_weights_seed": ns.seed,
        "data_shuffle_seed": ns.seed,
        "enable_tensorboard": False,
        "ici_pipeline_parallelism": 1,
        "ici_data_parallelism": ns.dp * (1 if pipelined else ns.pp),
        "ici_fsdp_parallelism": ns.fsdp,
        "ici_tensor_parallelism": ns.tp,
    }
    if ns.checkpoint_dir and pipelined:
        o["base_output_directory"] = ns.checkpoint_dir  # MaxText: <dir>/<run_name>/checkpoints
        if ns.checkpoint_every is not None:
            o["checkpoint_period"] = ns.checkpoint_every
        if ns.max_to_keep is not None:
            o["max_num_checkpoints_to_keep"] = ns.max_to_keep
    o["remat_policy"] = "full" if ns.remat else "none"
    if ns.tied_embeddings:
        o["logits_via_embedding"] = True
    if ns.model_name:
        o["model_name"] = ns.model_name
        if getattr(ns, "num_layers_given", False):
            o["override_model_config"] = True
            o["base_num_decoder_layers"] = ns.num_layers
    else:
        mlp = ns.mlp_dims or 4 * ns.model_dims
        o.update(
            decoder_block="llama2",
            base_emb_dim=ns.model_dims,
            base_num_decoder_layers=ns.num_layers,
            base_num_query_heads=ns.num_heads,
            base_num_kv_heads=ns.num_heads,
            base_mlp_dim=mlp,
            head_dim=ns.model_dims // ns.num_heads,
            vocab_size=ns.vocab_size,
        )
    if ns.backend == "cpu":
        o["attention"] = "dot_product"
        # XLA:CPU has no fast bfloat16, and float32 makes --compare-spmd exact (bfloat16
        # activations differ by ~1e-4 between shardings); --maxtext-override dtype=... wins
        o["dtype"] = "float32"
    for kv in ns.maxtext_override or ():
        k, _, v = kv.partition("=")  # cli.validate_maxtext checked the form
        o[k] = v
    return o


def argv_for(settings: dict[str, Any]) -> list[str]:
    """``train.main``'s argv: program name, ``base.yml``, then ``key=value``s."""
    return ["train", base_config(), *[f"{k}={v}" for k, v in settings.items()]]


# --- hooks ------------------------------------------------------------------------------


@dataclasses.dataclass
class Record:
    """What one MaxText run reports back through the hooks."""

    losses: list[float] = dataclasses.field(default_factory=list)
    step_times: list[float] = dataclasses.field(default_factory=list)
    config: Any = None
    first_step: int | None = None  # MaxText's start step (> 0 after restoring a checkpoint)
    mmesh: Any = None
    step_fn: Any = None
    on_step: Callable[[int, float, float], None] | None = None


def stage_of_layer(i: int, num_layers: int, num_stages: int) -> int:
    """Layer ``i``'s (virtual) stage: contiguous blocks of ``num_layers / num_stages``."""
    return i * num_stages // num_layers


def place_transformer(model: Any, num_stages: int) -> None:
    """Tag a MaxText NNX ``Transformer``'s modules with their stages (``mm.flax.task``)."""
    from multimesh import flax as mmflax

    cfg = model.config
    dec = model.decoder
    n = int(cfg.num_decoder_layers)
    layers = [getattr(dec, f"layers_{i}", None) for i in range(n)]
    if any(layer is None for layer in layers):
        raise HookError(
            f"--pp {num_stages}: MaxText's decoder has no decoder.layers_0..layers_{n - 1} "
            f"modules (decoder_block={cfg.decoder_block}, scan_layers={cfg.scan_layers}); "
            "pipelining needs scan_layers=False and a homogeneous decoder (llama2-style)."
        )
    last = num_stages - 1
    mmflax.task(model.token_embedder, stage=0, name="token_embedder")
    for i, layer in enumerate(layers):
        mmflax.task(layer, stage=stage_of_layer(i, n, num_stages), name=f"layers_{i}")
    for name in ("decoder_norm", "logits_dense"):
        mod = getattr(dec, name, None)
        if mod is not None:
            mmflax.task(mod, stage=last, name=name)


_OWNER = re.compile(r"^(layers_(\d+)|token_embedder|decoder_norm|logits_dense)$")


def _leaf_stage(path: Any, num_stages: int, num_layers: int) -> int | None:
    for k in path:
        name = str(getattr(k, "key", getattr(k, "name", k)))
        m = _OWNER.match(name)
        if m is None:
            continue
        if m.group(2) is not None:
            return stage_of_layer(int(m.group(2)), num_layers, num_stages)
        return 0 if name == "token_embedder" else num_stages - 1
    return None


class _PlacedStep:
    """The train step, with MaxText's initial state (replicated over the stages) first
    copied to the stages that own each leaf, so the first call and the later ones (fed the
    step's own stage-local outputs) use one program."""

    def __init__(
        self, step: Any, mmesh: Any, num_stages: int, num_layers: int, *, dump: bool = False
    ) -> None:
        self._step, self._mmesh = step, mmesh
        self._stages, self._layers = num_stages, num_layers
        self._pending: tuple[Any, Any] | None = None
        #: --dump: the step's plan text and the latest step's measured timeline
        self.dump = dump
        self.plan_text: str | None = None
        self.timeline: Any = None

    def _place(self, state: Any) -> Any:
        import multimesh as mm

        if self._pending is not None and self._pending[0] is state:
            return self._pending[1]
        flat, tree = jax.tree_util.tree_flatten_with_path(state)
        stages = [_leaf_stage(p, self._stages, self._layers) for p, _ in flat]
        specs = [getattr(getattr(x, "sharding", None), "spec", None) for _, x in flat]
        # leaves no stage owns (step counts) keep MaxText's sharding, replicated over the
        # stages, which the step's out_shardings keep too (MaxText reads them on every
        # process); the owned ones go to their stage
        moved = [k for k, st in enumerate(stages) if st is not None]

        def place(leaves: list[Any]) -> list[Any]:
            out = []
            for x, k in zip(leaves, moved):
                if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
                    out.append(x)  # PRNG keys: passed through
                    continue

                def copy(y: Any, spec: Any = specs[k]) -> Any:
                    y = y + 0
                    return y if spec is None else jax.lax.with_sharding_constraint(y, spec)

                st = stages[k]
                assert st is not None
                out.append(mm.task("place", stage=st % self._mmesh.num_stages)(copy)(x))
            return out

        placed = mm.jit(place, mesh=self._mmesh)([flat[k][1] for k in moved])
        leaves = [x for _, x in flat]
        for k, x in zip(moved, placed):
            leaves[k] = x
        new = jax.tree_util.tree_unflatten(tree, leaves)
        self._pending = (state, new)
        return new

    def lower(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        return self._step.lower(self._place(state), *args, **kwargs)

    def __call__(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        if self._pending is not None:
            state = self._place(state) if self._pending[0] is state else state
            self._pending = None
        if not self.dump:
            return self._step(state, *args, **kwargs)
        if self.plan_text is None:
            self.plan_text = self._step.lower(state, *args, **kwargs).as_text()
        if jax.process_count() > 1:
            return self._step(state, *args, **kwargs)
        out, self.timeline = self._step.record(state, *args, **kwargs)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)


def _replicated(mmesh: Any) -> Any:
    """Every device of the MultiMesh, replicated (spec without the MPMD axis)."""
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mmesh.mesh, PartitionSpec())


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set attributes for the duration of the block; put back (or delete) on exit."""
    missing = object()
    saved = [(obj, name, vars(obj).get(name, missing)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


@contextlib.contextmanager
def _jax_config_restored() -> Iterator[None]:
    """MaxText's ``initialize`` sets global JAX flags (PRNG implementation, Shardy); put
    them back afterwards."""
    names = ("jax_default_prng_impl", "jax_use_shardy_partitioner")
    saved = {n: getattr(jax.config, n) for n in names if hasattr(jax.config, n)}
    try:
        yield
    finally:
        for n, v in saved.items():
            if getattr(jax.config, n) != v:
                jax.config.update(n, v)


@contextlib.contextmanager
def hooks(ns: argparse.Namespace, record: Record, *, pipelined: bool) -> Iterator[None]:
    """Patch MaxText for one run (see the module docstring); restore everything on exit.
    ``pipelined=False`` installs only the loss recorder (the plain ``jax.jit`` reference)."""
    check_hooks()
    import multimesh as mm

    train = importlib.import_module(TRAIN)
    train_utils = importlib.import_module(TRAIN_UTILS)
    mt_utils = importlib.import_module(MAXTEXT_UTILS)
    models = importlib.import_module(MODELS)
    num_stages = ns.pp * ns.interleave

    orig_iteration = train.training_loop_iteration

    def training_loop_iteration(jax_device_state: Any, python_vars: Any, immutable: Any) -> Any:
        record.config = immutable["config"]
        if record.first_step is None:
            record.first_step = int(python_vars["step"])
        t0 = time.perf_counter()
        metrics = orig_iteration(jax_device_state, python_vars, immutable)
        loss = float(mm.distributed.to_host(metrics["scalar"]["learning/loss"]))
        dt = time.perf_counter() - t0
        record.losses.append(loss)
        record.step_times.append(dt)
        if record.on_step is not None:
            record.on_step(len(record.losses), loss, dt)
        return metrics

    patches: list[tuple[Any, str, Any]] = [
        (train, "training_loop_iteration", training_loop_iteration)
    ]
    if pipelined and getattr(ns, "checkpoint_dir", None) and jax.process_count() > 1:
        # MaxText's own Orbax checkpointing of stage-local state: each stage's arrays live
        # on one process, which Orbax otherwise refuses as host-local arrays
        mm.checkpoint.accept_mpmd_arrays()
    if pipelined:

        def get_mesh_from_config(config: Any, devices: Any = None) -> Any:
            axes = list(config.mesh_axes)
            sizes = [int(s) for s in config.ici_parallelism]
            if any(s < 1 for s in sizes) or len(sizes) != len(axes):
                raise ValueError(f"MaxText ici_parallelism {sizes} must be explicit per axis")
            devs = list(devices) if devices is not None else jax.devices()
            record.mmesh = mm.make_mesh(
                (ns.pp, *sizes), (MPMD_AXIS, *axes), stage_axis=MPMD_AXIS, devices=devs
            )
            return record.mmesh.mesh

        orig_init = models.Transformer.__init__

        def transformer_init(self: Any, *args: Any, **kwargs: Any) -> None:
            orig_init(self, *args, **kwargs)
            place_transformer(self, num_stages)

        def jit_train_step(
            config: Any,
            model: Any,
            state: Any,
            state_mesh_shardings: Any,
            data_sharding: Any,
            train_step: Any,
            params_shardings: Any,
            mesh: Any = None,
        ) -> Any:
            if config.enable_diloco or config.compiled_trainstep_file:
                raise ValueError(
                    "--model maxtext --pp: enable_diloco and compiled_trainstep_file are not "
                    "supported with MultiMesh pipelining"
                )
            fn, in_sh, _out_sh, static, donate = mt_utils.get_functional_train_with_signature(
                train_step, data_sharding, state_mesh_shardings, model, config, params_shardings
            )
            # the new state: a stage's leaves stay on the stage that owns them (MaxText's
            # global-mesh shardings would copy every parameter to every stage each step);
            # the others (step counts) keep MaxText's sharding, replicated over the stages
            # as _PlacedStep leaves them, so MaxText reads them on every process
            layers = int(config.num_decoder_layers)
            state_out = jax.tree_util.tree_map_with_path(
                lambda path, sh: sh if _leaf_stage(path, num_stages, layers) is None else None,
                state_mesh_shardings,
            )
            step = mm.jit(
                fn,
                mesh=record.mmesh,
                in_shardings=in_sh,
                # metrics: replicated over every submesh, as MaxText's jax.jit leaves them
                # (its metric logger reads them on every process)
                out_shardings=(state_out, _replicated(record.mmesh)),
                static_argnums=static,
                donate_argnums=donate,
            )
            # MaxText builds its state replicated over the stages; copying it to the owning
            # stages first lets every call (the first, fed that state, and the later ones,
            # fed the step's stage-local outputs) use one compiled program
            record.step_fn = _PlacedStep(
                step, record.mmesh, num_stages, layers, dump=bool(getattr(ns, "dump", None))
            )
            return record.step_fn

        def gradient_accumulation_loss_and_grad(
            _loss_fn: Any,
            config: Any,
            model: Any,
            params: Any,
            params_shardings: Any,
            data: Any,
            dropout_rng: Any,
        ) -> Any:
            return _microbatched_loss_and_grad(
                _loss_fn, config, model, data, ns.schedule, ns.interleave
            )

        patches += [
            (mt_utils, "get_mesh_from_config", get_mesh_from_config),
            (models.Transformer, "__init__", transformer_init),
            (train_utils, "jit_train_step", jit_train_step),
            (train, "gradient_accumulation_loss_and_grad", gradient_accumulation_loss_and_grad),
        ]
    with _jax_config_restored(), _patched(patches):
        yield


def _microbatched_loss_and_grad(
    loss_fn: Any, config: Any, model: Any, data: Any, schedule: str, interleave: int
) -> tuple[Any, Any, Any]:
    """MaxText's gradient accumulation (``maxtext.utils.gradient_accumulation``, NNX, no
    ZeRO-1) as ``mm.microbatch``: the same microbatches (row ``j`` of microbatch ``k`` is
    row ``j * M + k``), the token-summed loss divided by the total weight, the same
    gradient scaling and aux sums."""
    import jax.numpy as jnp
    from flax import nnx

    import multimesh as mm

    if not isinstance(model, nnx.Module):
        raise ValueError("--model maxtext: only MaxText's NNX models are supported")
    if config.shard_optimizer_over_data or getattr(
        config, "use_tunix_gradient_accumulation", False
    ):
        raise ValueError(
            "--model maxtext --num-microbatches > 1: shard_optimizer_over_data and "
            "use_tunix_gradient_accumulation are not supported with MultiMesh pipelining"
        )
    m = int(config.gradient_accumulation_steps)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    capacity = int(config.global_batch_size_to_train_on) * int(config.max_target_length)
    scale = 1.0 / float(capacity) if capacity > 0 else 1.0

    def one(params: Any, mb: Any) -> Any:
        def scaled(p: Any) -> Any:
            local = nnx.merge(graphdef, p, rest, copy=True)
            loss, aux = loss_fn(local, config, mb, None, None, is_train=True)
            return loss * scale, aux

        (_, aux), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        return grads, aux

    def stack(x: Any) -> Any:  # (B, ...) -> (M, B / M, ...), as MaxText's reshape + swapaxes
        return jnp.swapaxes(jnp.reshape(x, (x.shape[0] // m, m, *x.shape[1:])), 0, 1)

    sched: Any = schedule
    if interleave > 1:
        sched = mm.schedules.Interleaved1F1B(num_chunks=interleave)
    grads, aux = mm.microbatch(one, m, argnums=1, stacked=True, schedule=sched, reduce="sum")(
        params, jax.tree.map(stack, data)
    )
    weights = aux["total_weights"]
    has_weights = weights > 0
    denom = jnp.maximum(weights, 1)
    for key in ("moe_lb_loss", "indexer_loss", "mtp_loss"):
        if key in aux:
            aux[key] = aux[key] / m
    loss = (
        (aux["xent_sum"] + aux.get("dpo_loss", 0.0)) / denom
        + aux["moe_lb_loss"]
        + aux["indexer_loss"]
        + aux["mtp_loss"]
    )
    loss = jnp.where(has_weights, loss, 0.0)
    divisor = denom * scale
    grads = jax.tree.map(
        lambda g: jnp.where(has_weights, (g / divisor).astype(g.dtype), jnp.zeros_like(g)), grads
    )
    return loss, aux, grads


# --- the command ------------------------------------------------------------------------


RUN_NAME = "multimesh"


def saved_steps(checkpoint_dir: str) -> list[int]:
    """The complete MaxText checkpoints ``--checkpoint-dir`` holds (their steps)."""
    root = Path(checkpoint_dir) / RUN_NAME / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def train_once(ns: argparse.Namespace, *, pipelined: bool, on_step: Any = None) -> Record:
    """One MaxText training run (``train.main``) with the hooks; returns its record."""
    import absl.logging

    record = Record(on_step=on_step)
    train = importlib.import_module(TRAIN)
    with tempfile.TemporaryDirectory(prefix="multimesh-maxtext-") as out:
        settings = overrides(
            ns,
            run_name=RUN_NAME if pipelined else f"{RUN_NAME}-spmd",
            output_dir=out,
            pipelined=pipelined,
        )
        level = absl.logging.get_verbosity()
        if not ns.verbose:
            absl.logging.set_verbosity(absl.logging.WARNING)
        try:
            with hooks(ns, record, pipelined=pipelined):
                train.main(argv_for(settings))
        finally:
            absl.logging.set_verbosity(level)
    return record


def dump(ns: argparse.Namespace, rec: Record) -> tuple[str, str]:
    """``--dump DIR``: the train step's plan, the schedule's simulated Gantt chart, and
    (one process) the last step's measured Gantt chart and Perfetto trace."""
    import multimesh as mm

    step = rec.step_fn
    out = ns.dump
    wrote: list[str] = []
    if jax.process_index() == 0:
        os.makedirs(out, exist_ok=True)
        if step is not None and step.plan_text is not None:
            with open(os.path.join(out, "plan.txt"), "w") as fh:
                fh.write(step.plan_text + "\n")
            wrote.append("plan.txt")
        sched = mm.schedules.get(ns.schedule)
        if ns.interleave > 1 or ns.schedule == "interleaved-1f1b":  # as many chunks as run
            sched = mm.schedules.Interleaved1F1B(num_chunks=ns.interleave)
        mm.schedules.simulate(sched, ns.pp, ns.num_microbatches).plot(
            os.path.join(out, "simulated.png")
        )
        wrote.append("simulated.png")
        if step is not None and step.timeline is not None:
            step.timeline.plot(os.path.join(out, "measured.png"))
            step.timeline.to_chrome_trace(os.path.join(out, "trace.json"))
            wrote += ["measured.png", "trace.json (ui.perfetto.dev)"]
        elif jax.process_count() > 1:
            wrote.append("(measured timeline: single-process runs only)")
    return ("dumped to " + out, ", ".join(wrote))


def run(ns: argparse.Namespace) -> int:
    """``multimesh-run --model maxtext``: train, print the summary; 1 if ``--compare-spmd``
    finds a loss difference above ``--tolerance``."""
    from multimesh.run import report

    rank0 = jax.process_index() == 0
    check_hooks()  # cli.validate_maxtext has checked the flags
    model = ns.model_name or (
        f"llama2-style {ns.num_layers} layers x {ns.model_dims} wide, {ns.num_heads} heads"
    )
    if rank0:
        print(
            f"multimesh-run: MaxText {maxtext_version()} ({model}), {jax.device_count()} "
            f"{jax.devices()[0].platform} devices: pp={ns.pp} (x{ns.interleave} interleaved) "
            f"tp={ns.tp} dp={ns.dp} fsdp={ns.fsdp}, {ns.schedule}, {ns.num_microbatches} "
            f"microbatches of {ns.batch_size // ns.num_microbatches}"
        )
    bar = report.progress(ns.num_steps, not ns.no_progress, "training")

    def on_step(_k: int, loss: float, dt: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", step_ms=f"{dt * 1e3:.0f}")

    t0 = time.perf_counter()
    rec = train_once(ns, pipelined=True, on_step=on_step)
    total = time.perf_counter() - t0
    bar.close()
    if not rec.losses:
        return 0
    tokens_per_step = ns.batch_size * ns.sequence_length
    flops = 0.0
    if rec.config is not None:
        mt_utils = importlib.import_module(MAXTEXT_UTILS)
        tflops = mt_utils.calculate_tflops_training_per_device(rec.config, log=False)[0]
        flops = float(tflops) * 1e12 * jax.device_count()
    extra: list[tuple[str, str]] = [("MaxText train.main (setup + steps)", f"{total:.1f} s")]
    code = 0
    ref_losses: list[float] = []
    if ns.compare_spmd:
        ref_losses = train_once(ns, pipelined=False).losses
        if len(ref_losses) != len(rec.losses):
            raise RuntimeError(
                f"the jax.jit reference ran {len(ref_losses)} steps, MultiMesh {len(rec.losses)}"
            )
        # a NaN or inf on either side is a failure, not a match (max() skips NaNs)
        worst = max(
            (
                abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
                for a, b in zip(ref_losses, rec.losses)
            ),
            default=0.0,
        )
        ok = worst <= ns.tolerance
        extra.append(
            (
                "largest loss difference vs SPMD",
                f"{worst:.3e} ({'ok' if ok else 'FAILED'}, tolerance {ns.tolerance:g}; "
                f"MaxText unpipelined under jax.jit)",
            )
        )
        code = 0 if ok else 1
    if ns.dump:
        extra.append(dump(ns, rec))
    if rank0 and ns.metrics:
        import json

        with open(ns.metrics, "w") as fh:
            json.dump(
                {
                    "first_step": rec.first_step or 0,
                    "losses": rec.losses,
                    "reference_losses": ref_losses or None,
                    "step_times_s": rec.step_times,
                    "maxtext_version": maxtext_version(),
                    "settings": vars(ns),
                },
                fh,
                indent=1,
                default=str,
            )
    if rank0:
        print(report.summary(rec.step_times, tokens_per_step, flops, rec.losses, extra))
        if code:
            print(
                "multimesh-run: a loss is not finite (NaN or inf)"
                if not math.isfinite(worst)
                else "multimesh-run: the MPMD losses differ from MaxText under plain jax.jit "
                f"by more than --tolerance {ns.tolerance:g}"
            )
    return code


__all__ = [
    "HOOK_POINTS",
    "HookError",
    "check_hooks",
    "hooks",
    "overrides",
    "place_transformer",
    "run",
    "train_once",
]
