"""benchmarks/check.py flags ratios that got more than 20% worse, in either direction."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_check", ROOT / "benchmarks" / "check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def test_compare_flags_only_real_regressions(tmp_path):
    old = {"models": {"mlp": {"ratios": {"mm_vs_jax": 2.0, "parallel_speedup": 1.5}}},
           "rows": [{"speedup": 1.0, "t_mm_ms": 3.0}]}
    new = {"models": {"mlp": {"ratios": {"mm_vs_jax": 2.3, "parallel_speedup": 1.1}}},
           "rows": [{"speedup": 0.9, "t_mm_ms": 9.0}]}
    worse = check.compare(old, new, 0.2)
    assert len(worse) == 1 and worse[0].startswith("models/mlp/ratios/parallel_speedup")
    assert check.compare(new, old, 0.2) == []  # improvements are fine
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(old))
    b.write_text(json.dumps({"models": {"mlp": {"ratios": {"mm_vs_jax": 3.0}}}}))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "check.py"), "--compare",
                           str(a), str(b)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "mm_vs_jax: 2.000 -> 3.000 (+50% worse)" in proc.stdout
