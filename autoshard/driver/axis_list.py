"""The axes the driver runs, in mesh order (outer first): the one place the driver names them.

Each keeps the contract of :class:`autoshard.axes.contract.Axis`; the driver calls their hooks in
this order where an outer axis decides first (options, the cut of the captured graph) and in the
reverse order where an inner axis's work comes first (the plan's records and the emitted code: tp's
collectives are written into the code ep's exchanges then wrap, and FSDP gathers what the other
axes left on each rank). The mesh's own order of names is :data:`autoshard.core.mesh._ORDER`; this
list follows it, which ``tests/test_plan.py`` checks.
"""

from __future__ import annotations

from autoshard.axes.contract import Axis
from autoshard.axes.cp_axis import ContextAxis
from autoshard.axes.dp_axis import DataAxis
from autoshard.axes.ep_axis import ExpertAxis
from autoshard.axes.pp_axis import PipelineAxis
from autoshard.axes.tp_axis import TensorAxis

AXES: tuple[Axis, ...] = (PipelineAxis(), DataAxis(), ExpertAxis(), ContextAxis(), TensorAxis())
