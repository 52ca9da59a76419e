"""``python -m multimesh.run``: the same as the ``multimesh-run`` command."""

from multimesh.run.cli import entry

entry()
