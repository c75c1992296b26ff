"""Prove a pipeline plan: the tp code as any plan's, then the stages run one after another.

The stages' code is the emitted code cut at block boundaries, so one more proof run shows the cut
is exact: the stages called in order (:func:`~autoshard.passes.stage_graphs.stitched`), every value
crossing a boundary handed on as the schedule sends it, every tp rank simulated, compared output
by output and gradient by gradient with the unsharded graph as any proof is
(:func:`autoshard.proof.proof.prove`). A value the cut lost, passed in the wrong order or read before
the stage computing it would fail there, named by node.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from autoshard.passes.stage_graphs import stitched
from autoshard.proof.proof import Proof, prove


def prove_stages(pplan, model: nn.Module, example_inputs: tuple, example_kwargs: dict | None, *, seed: int = 0,
                 rtol: float | None = None) -> Proof:
    """The proof of ``pplan``'s stages, called in order, against the unsharded graph."""
    subject = pplan.emitted.subject
    root = stitched(pplan.split, pplan.emitted.parts.root)
    proof = prove(dataclasses.replace(subject, root=root), model, example_inputs, example_kwargs, seed=seed,
                  rtol=rtol)
    return dataclasses.replace(proof, plan=pplan.plan)
