"""MultiMesh for JAX: put parts of one jitted program on different submeshes (MPMD).

>>> import multimesh as mm
>>> mmesh = mm.make_mesh((2, 4), ("stage", "data"))
>>> step = mm.jit(train_step, mesh=mmesh)   # tasks inside run on their submeshes
"""

from multimesh import checkpoint as checkpoint
from multimesh import distributed as distributed
from multimesh import flax as flax
from multimesh import schedules as schedules
from multimesh.api import MpmdFunction as MpmdFunction
from multimesh.api import jit as jit
from multimesh.mesh import MultiMesh as MultiMesh
from multimesh.mesh import make_mesh as make_mesh
from multimesh.microbatch import microbatch as microbatch
from multimesh.stages import Compiled as Compiled
from multimesh.stages import Lowered as Lowered
from multimesh.stages import TracedCall as TracedCall
from multimesh.tasks import by_layer as by_layer
from multimesh.tasks import task as task

__version__ = "0.1.0"

__all__ = [
    "by_layer",
    "checkpoint",
    "distributed",
    "Compiled",
    "flax",
    "Lowered",
    "MpmdFunction",
    "MultiMesh",
    "jit",
    "make_mesh",
    "microbatch",
    "schedules",
    "task",
    "TracedCall",
]
