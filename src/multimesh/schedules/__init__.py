"""Pipeline schedules as data, with validation and simulation.

``GPipe()``, ``OneFOneB()`` (``"1f1b"``), ``Interleaved1F1B()``, ``ZeroBubbleH1()`` and
``Custom(order)``. ``simulate(schedule, num_stages, num_microbatches, ...)`` returns a
:class:`Timeline` (per-submesh events, makespan, bubble fraction, peak in-flight
activations) that can be plotted as a Gantt chart.
"""

from multimesh.schedules._builtin import Custom as Custom
from multimesh.schedules._builtin import GPipe as GPipe
from multimesh.schedules._builtin import Interleaved1F1B as Interleaved1F1B
from multimesh.schedules._builtin import OneFOneB as OneFOneB
from multimesh.schedules._builtin import ZeroBubbleH1 as ZeroBubbleH1
from multimesh.schedules._builtin import get as get
from multimesh.schedules._core import Action as Action
from multimesh.schedules._core import Schedule as Schedule
from multimesh.schedules._core import validate as validate
from multimesh.schedules._simulate import Event as Event
from multimesh.schedules._simulate import Timeline as Timeline
from multimesh.schedules._simulate import simulate as simulate

__all__ = [
    "Action",
    "Custom",
    "Event",
    "GPipe",
    "Interleaved1F1B",
    "OneFOneB",
    "Schedule",
    "Timeline",
    "ZeroBubbleH1",
    "get",
    "simulate",
    "validate",
]
