"""``multimesh-run``: train a transformer with pipeline x tensor x data x FSDP parallelism.

    multimesh-run                                   # our GPT on 8 virtual CPU devices
    multimesh-run --pp 2 --tp 2 --dp 2 --schedule zero-bubble-h1 --compare-spmd
    multimesh-run --model maxtext --model-name llama2-7b --pp 4 --fsdp 2 --backend gpu
    python -m multimesh.launch --nproc 2 --devices-per-process 4 -m multimesh.run

Every flag is documented in ``--help``. ``pp * tp * dp * fsdp`` must equal the number of
devices, the layers must divide by ``pp * interleave``, the batch by ``dp * fsdp *
microbatches``; a violation is a one-line error naming the flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble-h1")


#: files at the top of a single Orbax checkpoint (``multimesh.checkpoint.save``)
_ONE_CHECKPOINT = ("_METADATA", "_CHECKPOINT_METADATA")


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (``what`` names the bound in errors)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be a {what} integer, got {value}")
        return value

    return parse


_positive = _int_at_least(1, "positive")
_nonnegative = _int_at_least(0, "non-negative")


def _seed(text: str) -> int:
    """An argparse type: a seed ``jax.random.key`` takes (0 <= seed < 2**63)."""
    value = _nonnegative(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"must be below 2**63, got {value}")
    return value


def _finite_nonnegative(text: str) -> float:
    """An argparse type: a finite, non-negative float."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" unless the help already says its default, X is None or the
    flag takes no value."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or action.nargs == 0:
            return text
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="multimesh-run",
        description="Train a transformer with MultiMesh: pipeline (--pp) x tensor (--tp) x "
        "data (--dp) x FSDP (--fsdp) parallelism. --model gpt (default) trains MultiMesh's "
        "own GPT on synthetic tokens; --model maxtext trains unmodified MaxText through its "
        "own train loop.",
        formatter_class=_Formatter,
    )
    par = p.add_argument_group("parallelism (pp * tp * dp * fsdp = number of devices)")
    par.add_argument("--pp", type=_positive, default=None, help="pipeline stages (submeshes)")
    par.add_argument("--tp", type=_positive, default=1, help="tensor parallelism inside a stage")
    par.add_argument("--dp", type=_positive, default=None, help="data parallelism inside a stage")
    par.add_argument(
        "--fsdp", type=_positive, default=1, help="FSDP (sharded params) inside a stage"
    )
    par.add_argument(
        "--interleave",
        type=_positive,
        default=1,
        help="virtual stages per submesh (interleaved 1F1B)",
    )
    par.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=None,
        help="pipeline schedule (default: 1f1b, or interleaved-1f1b when --interleave > 1)",
    )
    mb = par.add_mutually_exclusive_group()
    mb.add_argument(
        "--num-microbatches", type=_positive, default=None, help="microbatches per step"
    )
    mb.add_argument("--microbatch-size", type=_positive, default=None, help="rows per microbatch")
    hw = p.add_argument_group("hardware")
    hw.add_argument(
        "--backend", choices=("cpu", "gpu", "tpu"), default="cpu", help="JAX backend"
    )
    hw.add_argument(
        "--cpus",
        type=_positive,
        default=None,
        help="virtual CPU devices (--backend cpu; default: pp*tp*dp*fsdp, or 8)",
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=("gpt", "maxtext"), default="gpt", help="which model")
    m.add_argument(
        "--model-name", default=None, help="a MaxText model config, e.g. llama2-7b (maxtext)"
    )
    m.add_argument(
        "--num-layers", type=_positive, default=None, help="decoder layers (default: pp*interleave)"
    )
    m.add_argument("--model-dims", type=_positive, default=64, help="embedding width")
    m.add_argument("--num-heads", type=_positive, default=4, help="attention heads")
    m.add_argument(
        "--mlp-dims", type=_positive, default=None, help="MLP width (default 4 x model dims)"
    )
    m.add_argument("--vocab-size", type=_positive, default=256, help="vocabulary size")
    m.add_argument("--remat", action="store_true", help="recompute each layer in the backward")
    m.add_argument(
        "--tied-embeddings",
        action="store_true",
        help="logits from the embedding table (used on the first and the last stage; its "
        "gradient is summed per stage and sent once per step) (gpt)",
    )
    m.add_argument(
        "--maxtext-override",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="an extra MaxText config setting, e.g. dtype=float32 (repeatable; maxtext)",
    )
    t = p.add_argument_group("training")
    t.add_argument("--batch-size", type=_positive, default=16, help="global batch (sequences)")
    t.add_argument("--sequence-length", type=_positive, default=32, help="tokens per sequence")
    t.add_argument("--num-steps", type=_positive, default=10, help="training steps")
    t.add_argument(
        "--learning-rate", type=_finite_nonnegative, default=3e-3, help="AdamW learning rate"
    )
    t.add_argument("--seed", type=_seed, default=0, help="random seed (init and data)")
    c = p.add_argument_group("checkpoints (Orbax, asynchronous; see mm.checkpoint)")
    c.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="save the training state (parameters and optimizer state) under DIR; with "
        "--model maxtext, MaxText's own async Orbax checkpointing, which resumes from DIR",
    )
    c.add_argument(
        "--checkpoint-every",
        type=_positive,
        default=None,
        metavar="N",
        help="save every N steps (default: only after the last step; MaxText: its "
        "checkpoint_period); needs --checkpoint-dir",
    )
    c.add_argument(
        "--max-to-keep",
        type=_positive,
        default=None,
        metavar="K",
        help="keep the K latest checkpoints",
    )
    c.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint in --checkpoint-dir (its layout "
        "may differ: a checkpoint restores into any --pp/--tp/--dp/--fsdp; give the saving "
        "run's --num-layers, which defaults to --pp x --interleave); steps run up to "
        "--num-steps in all; a directory without a complete checkpoint starts at step 0 "
        "(--model maxtext: MaxText's own restore of its latest step)",
    )
    o = p.add_argument_group("output and checks")
    o.add_argument(
        "--dump",
        default=None,
        metavar="DIR",
        help="write the plan text, a Perfetto trace and simulated/measured Gantt PNGs to DIR",
    )
    o.add_argument(
        "--compare-spmd",
        action="store_true",
        help="also run the same steps under plain jax.jit SPMD; exit non-zero if the largest "
        "loss difference exceeds --tolerance",
    )
    o.add_argument("--tolerance", type=_finite_nonnegative, default=1e-5, help="for --compare-spmd")
    o.add_argument(
        "--metrics",
        default=None,
        metavar="FILE",
        help="write the losses, step times and settings as JSON (rank 0)",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument(
        "--verbose", action="store_true", help="keep MaxText's own INFO logging (maxtext)"
    )
    return p


def validate(ns: argparse.Namespace, num_devices: int, p: argparse.ArgumentParser) -> None:
    """Fill defaults and check the flags against each other (one-line errors)."""
    if ns.interleave < 1:
        p.error("--interleave must be at least 1")
    if ns.schedule is None:
        ns.schedule = "interleaved-1f1b" if ns.interleave > 1 else "1f1b"
    if ns.interleave > 1 and ns.schedule != "interleaved-1f1b":
        p.error(f"--interleave {ns.interleave} needs --schedule interleaved-1f1b")
    dp_given = ns.dp is not None
    if ns.pp is None and ns.dp is None:
        ns.pp = max(1, min(4, num_devices // (ns.tp * ns.fsdp)))
    if ns.pp is None:
        ns.pp = max(1, num_devices // (ns.tp * ns.dp * ns.fsdp))
    if ns.dp is None:
        ns.dp = max(1, num_devices // (ns.pp * ns.tp * ns.fsdp))
    for flag in ("pp", "tp", "dp", "fsdp"):
        if getattr(ns, flag) < 1:
            p.error(f"--{flag} must be at least 1")
    total = ns.pp * ns.tp * ns.dp * ns.fsdp
    if total != num_devices:
        if getattr(ns, "multi_process", False):
            import jax

            where = f"on {jax.process_count()} processes" + (
                ": multimesh.launch's --nproc x --devices-per-process"
                if ns.backend == "cpu"
                else ""
            )
            hint = ""
        else:
            where = "--cpus / the GPUs"
            hint = (
                "; with --backend cpu, give --dp too (or --cpus): the virtual CPU devices "
                "default to pp*tp*dp*fsdp only when --pp and --dp are both given, else 8"
                if ns.backend == "cpu" and ns.cpus is None and not dp_given
                else ""
            )
        p.error(
            f"--pp {ns.pp} x --tp {ns.tp} x --dp {ns.dp} x --fsdp {ns.fsdp} = {total}, but "
            f"there are {num_devices} devices ({where}){hint}"
        )
    if ns.interleave > 1 and ns.pp < 2:
        p.error(
            f"--interleave {ns.interleave} needs --pp 2 or more: interleaving spreads a "
            "submesh's virtual stages between other submeshes' (with one pipeline stage, "
            "leave out --interleave)"
        )
    stages = ns.pp * ns.interleave
    ns.num_layers_given = ns.num_layers is not None
    if ns.num_layers is None:
        ns.num_layers = stages
    # a MaxText --model-name brings its own layer count (checked when the model is built)
    named = ns.model == "maxtext" and ns.model_name and not ns.num_layers_given
    if ns.num_layers % stages and not named:
        p.error(
            f"--num-layers {ns.num_layers} is not divisible by --pp {ns.pp} x --interleave "
            f"{ns.interleave} = {stages}"
        )
    data = ns.dp * ns.fsdp
    if ns.microbatch_size is not None:
        if ns.batch_size % ns.microbatch_size:
            p.error(
                f"--batch-size {ns.batch_size} is not divisible by --microbatch-size "
                f"{ns.microbatch_size}"
            )
        ns.num_microbatches = ns.batch_size // ns.microbatch_size
    if ns.num_microbatches is None:
        ns.num_microbatches = ns.pp
    m = ns.num_microbatches
    if ns.batch_size % (data * m):
        mb = (
            f"{m} microbatches (--batch-size / --microbatch-size {ns.microbatch_size})"
            if ns.microbatch_size is not None
            else f"--num-microbatches {m}"
        )
        p.error(
            f"--batch-size {ns.batch_size} is not divisible by --dp {ns.dp} x --fsdp {ns.fsdp} "
            f"x {mb} = {data * m}"
        )
    if ns.schedule == "interleaved-1f1b" and m % ns.pp and ns.interleave > 1:
        p.error(
            f"--schedule interleaved-1f1b needs --num-microbatches ({m}) divisible by --pp {ns.pp}"
        )
    if ns.model == "gpt" and ns.sequence_length < 2:
        p.error(f"--sequence-length {ns.sequence_length}: needs at least 2 (next-token targets)")
    if ns.model_dims % ns.num_heads:
        p.error(f"--model-dims {ns.model_dims} is not divisible by --num-heads {ns.num_heads}")
    if ns.model_dims % ns.tp or (ns.mlp_dims or 4 * ns.model_dims) % ns.tp:
        p.error(f"--model-dims {ns.model_dims} / --mlp-dims must be divisible by --tp {ns.tp}")
    if not ns.checkpoint_dir:
        for flag, given in (
            ("--resume", ns.resume),
            ("--checkpoint-every", ns.checkpoint_every is not None),
            ("--max-to-keep", ns.max_to_keep is not None),
        ):
            if given:
                p.error(f"{flag} needs --checkpoint-dir")
    elif os.path.exists(ns.checkpoint_dir) and not os.path.isdir(ns.checkpoint_dir):
        p.error(f"--checkpoint-dir {ns.checkpoint_dir} is a file, not a directory")
    elif not os.path.isdir(ns.checkpoint_dir):
        try:  # made now: a path that cannot be a directory fails here, not after step 1
            os.makedirs(ns.checkpoint_dir, exist_ok=True)
        except OSError as e:
            p.error(f"--checkpoint-dir {ns.checkpoint_dir}: cannot create it ({e.strerror})")
    for flag, path in (("--metrics", ns.metrics), ("--dump", ns.dump)):
        if path is not None and not path.strip():
            p.error(f"{flag} needs a path (got an empty one)")
    if ns.metrics is not None and os.path.isdir(ns.metrics):
        p.error(f"--metrics {ns.metrics} is a directory; give a file name")
    if ns.dump is not None and os.path.exists(ns.dump) and not os.path.isdir(ns.dump):
        p.error(f"--dump {ns.dump} is a file; give a directory")
    for flag, path in (("--metrics", ns.metrics), ("--dump", ns.dump)):
        parent = os.path.dirname(os.path.abspath(path)) if path is not None else None
        if parent is not None and not os.path.isdir(parent):  # else it fails after training
            p.error(f"{flag} {path}: the directory {parent} does not exist")
    if ns.checkpoint_every is not None and ns.checkpoint_every < 1:
        p.error("--checkpoint-every must be at least 1")
    if ns.max_to_keep is not None and ns.max_to_keep < 1:
        p.error("--max-to-keep must be at least 1")
    if ns.model != "maxtext":
        for flag, given in (
            ("--model-name", ns.model_name is not None),
            ("--maxtext-override", ns.maxtext_override is not None),
        ):
            if given:
                p.error(f"{flag} is for --model maxtext (this run trains --model {ns.model})")
    if ns.checkpoint_dir:
        from multimesh.checkpoint import foreign_steps

        foreign = foreign_steps(ns.checkpoint_dir)
        if foreign and ns.model != "maxtext":
            p.error(
                f"--checkpoint-dir {ns.checkpoint_dir} holds numbered folders that are not "
                f"checkpoints ({', '.join(foreign[:5])}); use a directory of its own"
            )
        if any(os.path.exists(os.path.join(ns.checkpoint_dir, m)) for m in _ONE_CHECKPOINT):
            p.error(
                f"--checkpoint-dir {ns.checkpoint_dir} is one checkpoint (as "
                "multimesh.checkpoint.save writes), not a directory of numbered steps; use a "
                "directory of its own"
            )
        # absolute: Orbax refuses relative paths (MaxText passes it on as given)
        ns.checkpoint_dir = os.path.abspath(ns.checkpoint_dir)
    if ns.model == "maxtext" and sys.version_info < (3, 12):
        p.error("--model maxtext needs Python >= 3.12 (MaxText 0.2.5)")
    if ns.model == "maxtext":
        validate_maxtext(ns, p)
    elif ns.checkpoint_dir and not ns.resume:
        from multimesh.checkpoint import saved_steps

        steps = saved_steps(ns.checkpoint_dir)
        if steps:  # its steps would be kept and this run's silently not saved
            p.error(
                f"--checkpoint-dir {ns.checkpoint_dir} holds checkpoints (steps {steps}); "
                "pass --resume to continue from the latest, or use another directory"
            )


def validate_maxtext(ns: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """What ``--model maxtext`` does not support (yet), as one-line errors."""
    if ns.checkpoint_dir:
        import jax

        from multimesh.run.maxtext import saved_steps

        steps = saved_steps(ns.checkpoint_dir)
        # MaxText always continues from a checkpoint it finds: make that explicit
        if steps and not ns.resume:
            p.error(
                f"--checkpoint-dir {ns.checkpoint_dir} holds MaxText checkpoints (steps "
                f"{steps}); pass --resume to continue from the latest, or use another directory"
            )
        if ns.resume and jax.process_index() == 0:
            print(
                f"multimesh-run: MaxText resumes from its step {steps[-1]} checkpoint in "
                f"{ns.checkpoint_dir}"
                if steps
                else f"multimesh-run: no checkpoint in {ns.checkpoint_dir}; starting at step 0"
            )
    if ns.compare_spmd and ns.checkpoint_dir:
        # MaxText resumes from DIR, and its learning-rate schedule spans the saving run's
        # steps: a fresh jax.jit reference would not train the same steps
        p.error("--compare-spmd and --checkpoint-dir cannot be combined with --model maxtext")
    for kv in ns.maxtext_override or ():
        if "=" not in kv or kv.startswith("="):
            p.error(f"--maxtext-override {kv!r}: expected KEY=VALUE, e.g. dtype=float32")


def setup_backend(ns: argparse.Namespace) -> bool:
    """Configure JAX before it starts; returns whether this is a multi-process run."""
    import multimesh as mm

    multi = mm.distributed.initialize()
    import jax

    want = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}[ns.backend]
    if jax.config.jax_platforms != want:
        jax.config.update("jax_platforms", want)
    if ns.backend == "cpu" and not multi:
        n = ns.cpus
        if n is None:
            flags = [ns.pp, ns.dp]
            n = ns.pp * ns.tp * ns.dp * ns.fsdp if None not in flags else 8
        if jax.config.jax_num_cpu_devices != int(n):
            try:
                jax.config.update("jax_num_cpu_devices", int(n))
            except RuntimeError:
                pass  # JAX already started (e.g. called from Python): validate says so
    return multi


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    ns = p.parse_args(argv)
    if ns.cpus is not None and ns.cpus < 1:
        p.error("--cpus must be at least 1")
    ns.multi_process = setup_backend(ns)
    if ns.multi_process and ns.cpus is not None:
        p.error(
            "--cpus does not apply to a multi-process run: each process's CPU devices "
            "are set where it is started (multimesh.launch --devices-per-process)"
        )
    import jax

    try:
        num_devices = jax.device_count()
    except (RuntimeError, AssertionError) as e:  # no such backend on this machine
        why = f" ({e})" if str(e) else ""
        p.error(f"--backend {ns.backend}: JAX found no {ns.backend.upper()} devices here{why}")
    validate(ns, num_devices, p)
    import multimesh as mm

    try:
        if ns.model == "maxtext":
            from multimesh.run import maxtext

            return maxtext.run(ns)
        from multimesh.run import gpt

        return gpt.run(ns)
    except mm.distributed.LayoutError as e:  # the processes split a stage: a usage error
        p.error(f"--pp {ns.pp} x --dp {ns.dp} x --fsdp {ns.fsdp} x --tp {ns.tp}: {e}")


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
