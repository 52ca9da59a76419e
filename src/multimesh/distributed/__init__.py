"""Multi-process MPMD on JAX's own distributed runtime (``jax.distributed``).

One script runs unchanged as one process, under ``python -m multimesh.launch``, under
SLURM or Open MPI::

    mm.distributed.initialize()          # a no-op in a plain single process
    mmesh = mm.make_mesh((4, 2), ("stage", "data"))     # over every process's devices
    step = mm.jit(train_step, mesh=mmesh)
    state, loss = step(state, batch)
    print(mm.distributed.to_host(loss))  # works on any process, wherever loss lives

Every process traces and plans the same program and runs the fragments on its own
devices; values move between processes through a transport chosen per backend.
"""

from multimesh.distributed._host import to_host as to_host
from multimesh.distributed._init import LayoutError as LayoutError
from multimesh.distributed._init import check_layout as check_layout
from multimesh.distributed._init import initialize as initialize
from multimesh.distributed._init import is_multiprocess as is_multiprocess
from multimesh.distributed._init import process_map as process_map

__all__ = ["LayoutError", "check_layout", "initialize", "is_multiprocess", "process_map", "to_host"]
