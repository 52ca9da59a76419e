"""Regression check: rerun benchmarks and report ratios more than 20% worse than the
committed results (run by hand; CI machines are too noisy for timing gates).

Ratios are compared, never absolute times: keys containing ``ratio`` or ``_vs_`` (lower
is better: time against a baseline) and ``speedup`` or ``efficiency`` (higher is
better). Exit status 1 when any ratio regressed.

Run:  python benchmarks/check.py [step first_call dispatch pipeline ...] [--threshold 0.2]
      python benchmarks/check.py --compare OLD.json NEW.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def ratios(tree: Any, path: str = "") -> Iterator[tuple[str, float, bool]]:
    """(key path, value, lower_is_better) of every ratio in a results tree."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from ratios(v, f"{path}/{k}" if path else str(k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from ratios(v, f"{path}[{i}]")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        leaf = path.rsplit("/", 1)[-1].lower()
        if "speedup" in leaf or "efficiency" in leaf:
            yield path, float(tree), False
        elif "ratio" in leaf or "_vs_" in leaf:
            yield path, float(tree), True


def compare(old: Any, new: Any, threshold: float) -> list[str]:
    """Lines describing every ratio in ``new`` more than ``threshold`` worse than in
    ``old`` (keys present in both)."""
    base = {p: (v, low) for p, v, low in ratios(old)}
    worse = []
    for p, v, low in ratios(new):
        if p not in base or base[p][0] <= 0 or v <= 0:
            continue
        b = base[p][0]
        change = v / b - 1 if low else b / v - 1
        if change > threshold:
            worse.append(f"{p}: {b:.3f} -> {v:.3f} ({change * 100:+.0f}% worse)")
    return worse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("benchmarks", nargs="*", default=["step", "first_call", "dispatch", "pipeline"])
    ap.add_argument("--threshold", type=float, default=0.2)
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), type=Path)
    ns = ap.parse_args()
    pairs: list[tuple[str, Path, Path]] = []
    if ns.compare:
        pairs.append(("compare", *ns.compare))
    else:
        pyver = ".".join(platform.python_version_tuple()[:2])
        tmp = Path(tempfile.mkdtemp())
        for name in ns.benchmarks:
            committed = HERE / "results" / f"{name}-{pyver}.json"
            if not committed.exists():
                print(f"{name}: no committed results for Python {pyver} ({committed}); skipped")
                continue
            fresh = tmp / f"{name}.json"
            cmd = [sys.executable, str(HERE / f"{name}.py"), "--out", str(fresh)]
            print("running", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, timeout=3600)
            pairs.append((name, committed, fresh))
    bad = 0
    for name, old, new in pairs:
        worse = compare(json.loads(old.read_text()), json.loads(new.read_text()), ns.threshold)
        print(f"{name}: {len(worse)} ratio(s) more than {ns.threshold:.0%} worse")
        for line in worse:
            print("  " + line)
        bad += len(worse)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
