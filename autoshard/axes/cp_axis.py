"""The context-parallel axis ``cp``: the sequence (dim 1 of the first input) cut over cp ranks.

cp rewrites the captured graph into one cp rank's code before any site is found
(:mod:`autoshard.passes.cut_sequence`): each rank holds two chunks of the sequence, attention runs
over every rank's keys and values, and an op that mixes positions reads its input whole. The rest of
planning then sees a graph of local length. Its record (:class:`~autoshard.plans.context_plan.ContextPlan`)
is what the cut did and what cp moves per step; its ranks are on the proof's grid, each on its own
positions; a sharded module carries the global positions of its part of the sequence.
"""

from __future__ import annotations

import dataclasses

import torch

from autoshard.axes.contract import Axis, PlanResult
from autoshard.core.errors import in_stage
from autoshard.core.mesh import CP, MeshAxes
from autoshard.core.options import PlanOptions
from autoshard.passes.cp_traffic import cp_traffic
from autoshard.passes.cut_sequence import SEQ_DIM, cut_sequence
from autoshard.plans.plan import Plan
from autoshard.runtime.context_ops import local_positions


class ContextAxis(Axis):
    names = (CP,)
    proven_on_grid = True

    def plan_options(self, options: PlanOptions, axes: MeshAxes) -> PlanOptions:
        if options.context_output != "whole" and not self.present(axes):
            raise ValueError("autoshard: context_output configures context parallelism, and this mesh has no 'cp' axis")
        return options

    def cut(self, captured, axes: MeshAxes, options: PlanOptions, example_inputs: tuple):
        """The captured graph rewritten into one cp rank's code; the cut's record."""
        if options.dynamic_shapes is not None:
            raise NotImplementedError("autoshard: context parallelism cuts a sequence of fixed length; capture with "
                                      "dynamic_shapes=None")
        first = example_inputs[0] if example_inputs else None
        if not isinstance(first, torch.Tensor) or first.dim() <= SEQ_DIM:
            what = list(first.shape) if isinstance(first, torch.Tensor) else type(first).__name__
            raise ValueError("autoshard: context parallelism cuts dim 1 ([batch, seq, ...]) of the first input, and "
                             f"the first example input is {what}")
        with in_stage("cut the sequence", captured.gm.graph):
            return cut_sequence(captured.gm, int(first.shape[SEQ_DIM]), axes.cp, self.group(axes),
                                set(captured.param_shapes), local_outputs=options.context_output == "local")

    def record(self, plan: Plan, planned: PlanResult, axes: MeshAxes, options: PlanOptions, cut) -> Plan:
        traffic = cp_traffic(planned.captured.gm, planned.layout_plan.layouts, axes.tp)
        return dataclasses.replace(plan, context=dataclasses.replace(cut, collectives=traffic))

    def grid(self, axes: MeshAxes) -> dict[str, int]:
        return {CP: axes.cp}

    def on_ranks(self, sharded, plan: Plan, axes: MeshAxes) -> None:
        """The global positions of this rank's part of the sequence (its outputs', if left cut), on
        the device materialize places tensors on."""
        sharded.cp_positions = local_positions(axes.mesh.get_local_rank(CP), axes.cp, plan.context.seq,
                                               torch.device(axes.mesh.device_type))
