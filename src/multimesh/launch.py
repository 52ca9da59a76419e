"""``python -m multimesh.launch``: see :mod:`multimesh.distributed.launch`."""

import sys

from multimesh.distributed.launch import main

if __name__ == "__main__":
    sys.exit(main())
