"""Every Python snippet in the README runs as written, in order, in one fresh process."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_snippets_run(tmp_path):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 3
    script = tmp_path / "readme.py"
    script.write_text("\n\n".join(blocks))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MPMD plan" in proc.stdout and "loss" in proc.stdout
    assert (tmp_path / "trace.json").exists()


def test_readme_links_stay_in_the_repo():
    text = (ROOT / "README.md").read_text()
    assert "<image>" not in text and "shared folder" not in text
    # GitHub's heading anchors: lower case, punctuation dropped, spaces as dashes
    anchors = {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", text, flags=re.M)
    }
    for link in re.findall(r"\]\(([^)]+)\)", text):
        if link.startswith("#"):
            assert link[1:] in anchors, (link, sorted(anchors))
        elif not link.startswith("http"):
            assert (ROOT / link).exists(), link
