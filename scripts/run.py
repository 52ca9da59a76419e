#!/usr/bin/env python
"""A thin shim: ``python scripts/run.py ...`` is ``multimesh-run ...``."""

from multimesh.run.cli import entry

if __name__ == "__main__":
    entry()
