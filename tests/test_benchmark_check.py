"""benchmarks/check.py flags ratios that got more than 20% worse, in either direction."""

import importlib.util
import json
import os
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


def test_step_benchmark_runs_bit_identical_and_reports_every_target(tmp_path):
    """benchmarks/step.py --quick: the pipelined step equals jax.jit bit for bit, and
    the report carries both baselines and issue 14's targets (values, not timing gates)."""
    out = tmp_path / "step.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step.py"), "--quick", "--widths", "256",
         "--schedules", "1f1b", "interleaved-1f1b", "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT / "benchmarks",
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},  # XLA's defaults
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [c["schedule"] for c in res["configs"]] == ["1f1b", "interleaved-1f1b"]
    for c in res["configs"]:
        assert c["max_abs_diff_vs_jax"] == 0.0
        assert c["scan_step_us"] > 0 and c["unrolled_step_us"] > 0 and c["mm_step_us"] > 0
        assert 0 < c["return_ratio"] < 1.5
        assert set(c["overhead_per_fragment_us"]) == {"scan", "unrolled"}
    names = [t["target"] for t in res["targets"]]
    assert any("interleaved vs 1f1b" in n for n in names)
    assert any("call return" in n for n in names) and any("first call" in n for n in names)
    assert all(isinstance(t["met"], bool) for t in res["targets"])
    # the regression check finds the step ratios in it
    keys = [p for p, _v, _low in check.ratios(res)]
    assert any(k.endswith("mm_vs_scan") for k in keys) and any(k.endswith("return_ratio") for k in keys)
    assert set(res["interleaved_vs_1f1b"]["256"]) == {"raw_ratio", "own_scan_ratio"}
    assert any(k.startswith("interleaved_vs_1f1b/256") for k in keys)
