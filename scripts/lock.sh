#!/usr/bin/env bash
# Regenerate the hash-locked requirements the container images install with --require-hashes:
#   docker/requirements/{cpu,cuda12}-py{3.11,3.12}.txt   (Linux x86_64)
# from pyproject.toml's dependencies and extras (cpu: run,docs,test; cuda12: run,docs,checkpoint
# maxtext plus docker/requirements/cuda12.in) and docker/requirements/build.in.
#
#   pip install uv && scripts/lock.sh          # then commit docker/requirements/
#
# tests/test_locks.py fails when pyproject.toml and these files disagree.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v uv >/dev/null 2>&1 || { echo "lock.sh: needs uv (pip install uv)" >&2; exit 1; }

req=docker/requirements
for py in 3.11 3.12; do
  for variant in cpu cuda12; do
    sources=(pyproject.toml "$req/build.in")
    extras=(--extra run --extra docs)
    if [ "$variant" = cpu ]; then
      extras+=(--extra test)
    else
      sources+=("$req/cuda12.in")
      extras+=(--extra checkpoint --extra maxtext)
    fi
    uv pip compile "${sources[@]}" "${extras[@]}" \
      --python-version "$py" --python-platform x86_64-manylinux_2_28 \
      --generate-hashes --index-url https://pypi.org/simple --no-config \
      --custom-compile-command "scripts/lock.sh" \
      --quiet -o "$req/$variant-py$py.txt"
    echo "wrote $req/$variant-py$py.txt"
  done
done
