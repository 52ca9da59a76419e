"""What ``multimesh-run`` prints: a progress bar while training and a summary table."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import jax

# dense bf16/fp16 peak FLOP/s per device, where known (for model FLOPs utilisation)
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "V100": 125e12,
    # TPUs by device_kind, the more specific names first ("TPU v5 lite" holds "TPU v5")
    "TPU v6 lite": 918e12,
    "TPU v5 lite": 197e12,
    "TPU v5": 459e12,
    "TPU v4": 275e12,
}


def progress(steps: int, enabled: bool, desc: str, initial: int = 0) -> Any:
    """A tqdm progress bar (rank 0 only), or a quiet stand-in."""
    if enabled and jax.process_index() == 0:
        from tqdm import tqdm

        return tqdm(total=steps, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
    return _Quiet()


class _Quiet:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *a: Any, **k: Any) -> None:
        pass

    def close(self) -> None:
        pass


def peak_flops() -> float | None:
    dev = jax.devices()[0]
    if dev.platform not in ("gpu", "cuda", "tpu"):
        return None
    kind = getattr(dev, "device_kind", "")
    for name, flops in PEAK_FLOPS.items():
        if name in kind:
            return flops
    return None


def peak_memory_bytes() -> int | None:
    """The largest peak bytes in use over this process's devices, where reported."""
    peaks = []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - not every backend reports
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def summary(
    step_times: Sequence[float],
    tokens_per_step: int,
    flops_per_step: float,
    losses: Sequence[float],
    extra: Iterable[tuple[str, str]] = (),
) -> str:
    """The end-of-run table (steady state: the first step, which compiles, is left out)."""
    steady = list(step_times[1:]) or list(step_times)
    med = statistics.median(steady)
    peak = peak_flops()
    mem = peak_memory_bytes()
    rows = [
        ("steps", str(len(step_times))),
        ("first step (compile + run)", f"{step_times[0]:.3f} s"),
        ("step time (median)", f"{med * 1e3:.1f} ms"),
        ("tokens/s", f"{tokens_per_step / med:,.0f}"),
        ("model FLOPs / step", f"{flops_per_step:.3e}"),
        (
            "model FLOPs utilisation",
            "n/a (peak unknown on this device)"
            if peak is None
            else f"{flops_per_step / med / (peak * jax.device_count()):.1%}",
        ),
        (
            "peak memory / device",
            "n/a (not reported)" if mem is None else f"{mem / 2**20:,.1f} MiB",
        ),
        ("loss first -> last", f"{losses[0]:.5f} -> {losses[-1]:.5f}"),
        *extra,
    ]
    w = max(len(k) for k, _ in rows)
    line = "-" * (w + 30)
    return "\n".join([line, *[f"{k:<{w}}  {v}" for k, v in rows], line])
