"""Shared by the benchmarks: 8 virtual CPU devices, run metadata, writing results.

Import this module before ``jax`` so the device count is set in time.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import jaxlib  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

RESULTS = Path(__file__).resolve().parent / "results"


def environment(name: str, quick: bool) -> dict[str, Any]:
    """What every results file records about the run."""
    import multimesh as mm

    return {
        "benchmark": name,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None),
        "multimesh": mm.__version__,
        "platform": jax.devices()[0].platform,
        "num_devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "quick": quick,
    }


def write_results(out: dict[str, Any], path: Path | None) -> Path:
    """Write ``out`` as JSON (default: results/<benchmark>-<python>[-quick].json)."""
    if path is None:
        pyver = ".".join(platform.python_version_tuple()[:2])
        path = RESULTS / f"{out['benchmark']}-{pyver}{'-quick' if out['quick'] else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {path} ({out.get('wall_s')} s)")
    return path
