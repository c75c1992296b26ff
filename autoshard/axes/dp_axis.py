"""The data axis: ``dp``, or HSDP's ``dp_replicate x dp_shard``; FSDP2 cuts every parameter over it.

Every rank of it takes its own batch and runs the same code, so it rewrites nothing: its part in
planning is each parameter's FSDP dim (the plan's dense stage decides it, :mod:`autoshard.passes.placements`),
the all-gathers it quantizes (:mod:`autoshard.plans.block_quant`), and the dtype FSDP2's
mixed-precision policy computes in, which the graph is captured in. It takes part on every mesh: a
mesh without a data axis is data parallel of degree one, and its plan says what FSDP does not gather.
"""

from __future__ import annotations

from autoshard.axes.contract import Axis, PlanResult
from autoshard.core.mesh import DP, DP_REPLICATE, DP_SHARD, MeshAxes, dp_choice
from autoshard.core.options import Options, PlanOptions
from autoshard.core.sharding import REPLICATED, Role, shard_on
from autoshard.plans.block_quant import with_quantized_gathers
from autoshard.plans.plan import Plan


class DataAxis(Axis):
    names = (DP_REPLICATE, DP_SHARD, DP)

    def takes_part(self, axes: MeshAxes) -> bool:
        return True

    def check(self, axes: MeshAxes, chosen: Options, sharding: bool) -> None:
        if sharding and chosen.precision.mp_policy is not None and not axes.has_dp:
            raise ValueError(
                "autoshard: mp_policy is applied by FSDP2 on the dp axis, and this mesh has none "
                f"({axes.to_dict()}); on a mesh without dp cast the model (model.to(torch.bfloat16)) instead"
            )

    def capture_dtype(self, options: PlanOptions, axes: MeshAxes):
        # FSDP2 casts the gathered parameters to param_dtype, so the graph computes in it; a dynamo
        # graph replayed node by node (the compile backend) holds those casts in the graph itself
        return options.mp_policy.param_dtype if options.mp_policy is not None and axes.has_dp else None

    def check_saved(self, saved: Plan, axes: MeshAxes) -> None:
        for fqn, entry in saved.params.items():
            choice = dp_choice(entry.placements)
            allowed = (shard_on(1 if entry.role == Role.VOCAB_PARALLEL else 0), REPLICATED)
            if choice not in (None, *allowed):
                raise ValueError(
                    f"autoshard: plan gives '{fqn}' ({entry.role}) dp placement '{choice}'; expected "
                    f"{' or '.join(repr(str(a)) for a in allowed)}"
                )

    def record(self, plan: Plan, planned: PlanResult, axes: MeshAxes, options: PlanOptions, cut) -> Plan:
        if options.all_gather_quant is None:
            return plan
        return with_quantized_gathers(plan, axes, options.all_gather_quant)
