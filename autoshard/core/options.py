"""Planning options: one frozen object handed through capture, propagation and retargeting.

The public functions (:func:`autoshard.autoshard`, :func:`autoshard.plan`, the
compile backend) keep plain keyword arguments; they build one
:class:`PlanOptions`, checked once, and the stages read it instead of taking a
positional chain of flags.
"""

from __future__ import annotations

import dataclasses

from autoshard.plans.block_quant import BlockQuant

ON_INDIVISIBLE = ("replicate", "error")
CONTEXT_OUTPUTS = ("whole", "local")


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """``on_indivisible``: replicate over tp (noted) or refuse a weight whose sharded dim does
    not divide by tp. ``loss_parallel``: outputs sharded over their last dim leave as DTensors.
    ``sequence_parallel``: the residual stream is sharded over the sequence between blocks.
    ``dynamic_shapes``: ``torch.export``'s spec for symbolic batch and sequence dims.
    ``mp_policy``: FSDP2's mixed-precision policy, which autoshard's tp sums follow too.
    ``all_gather_quant``: a :class:`~autoshard.plans.block_quant.BlockQuant` for FSDP's all-gathers.
    ``trace_blocks_once``: trace a stack of identical blocks as two and write the rest
    (the same graph, much faster on deep models); ``False`` traces every block.
    ``context_output``: on a mesh with a cp axis, outputs cut along the sequence come back
    gathered (``"whole"``) or as each rank's positions (``"local"``)."""

    on_indivisible: str = "replicate"
    loss_parallel: bool = False
    sequence_parallel: bool = False
    dynamic_shapes: object = None
    mp_policy: object = None  # torch.distributed.fsdp.MixedPrecisionPolicy
    all_gather_quant: object = None  # autoshard.BlockQuant
    trace_blocks_once: bool = True
    context_output: str = "whole"  # on a cp axis: outputs gathered whole, or "local": left cut

    def __post_init__(self) -> None:
        if self.context_output not in CONTEXT_OUTPUTS:
            raise ValueError(f"autoshard: context_output must be 'whole' or 'local', got {self.context_output!r}")
        if self.on_indivisible not in ON_INDIVISIBLE:
            raise ValueError(
                f"autoshard: on_indivisible must be 'replicate' or 'error', got {self.on_indivisible!r}"
            )
        if self.all_gather_quant is not None and not isinstance(self.all_gather_quant, BlockQuant):
            raise ValueError(
                "autoshard: all_gather_quant must be an autoshard.BlockQuant (e.g. "
                f"BlockQuant(dtype=torch.float8_e4m3fn, block=128)), got {type(self.all_gather_quant).__name__}"
            )

    def for_tp(self, has_tp: bool) -> PlanOptions:
        """Loss and sequence parallelism exist only with a tp axis."""
        if has_tp:
            return self
        return dataclasses.replace(self, loss_parallel=False, sequence_parallel=False)

    def strict(self) -> PlanOptions:
        """Every weight's role must hold as planned (retargeting checks a saved plan)."""
        return dataclasses.replace(self, on_indivisible="error")


DEFAULT_OPTIONS = PlanOptions()
