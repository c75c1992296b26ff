"""The code the passes hand the runtime: the partitioned module and a pipeline's stage graphs.

The passes write these records and the runtime runs them, so they are defined at the runtime's
layer, below the passes that fill them.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx


@dataclasses.dataclass(frozen=True)
class Partitioned:
    """The root GraphModule and one GraphModule per block (each an FSDP unit), at its FQN."""

    root: fx.GraphModule
    blocks: dict[str, fx.GraphModule]


@dataclasses.dataclass(frozen=True)
class StageGraph:
    """One pipeline stage's code: ``module`` holds its blocks (at their FQNs) and the parameters and
    buffers its root nodes read. ``receives``/``sends`` name the root graph's values it takes and
    hands on (the model's flat inputs for the first stage, its flat outputs for the last)."""

    index: int
    module: fx.GraphModule
    blocks: tuple[str, ...]
    receives: tuple[str, ...]
    sends: tuple[str, ...]
    params: tuple[str, ...]  # every parameter FQN the stage holds (its blocks' and its root reads')


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """The stages in order, and the root graph's values crossing each boundary (``carried[k]``:
    from stage ``k`` to ``k + 1``)."""

    stages: tuple[StageGraph, ...]
    carried: tuple[tuple[str, ...], ...]
