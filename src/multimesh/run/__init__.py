"""``multimesh-run``: the training helper (see :mod:`multimesh.run.cli`)."""

from multimesh.run.cli import main as main

__all__ = ["main"]
