"""Carry a plan's tp decisions into hand-written stacks: ``parallelize_module`` and Hugging Face.

A :class:`~autoshard.plans.plan.Plan` decides, per weight, which dim tp cuts. Two
other vocabularies can say most of it:

* PyTorch's ``parallelize_module`` takes ``{module FQN: ParallelStyle}``.
  ``ColwiseParallel`` on an ``nn.Linear`` cuts its ``[out, in]`` weight on dim
  0 (the same output columns per rank as autoshard's colwise, stored
  ``[in, out]`` cut on dim 1: the split is equal, the storage is not),
  ``RowwiseParallel`` cuts dim 1 as autoshard's rowwise does, and on an
  ``nn.Embedding`` they cut the embedding dim and the vocabulary rows.
* Hugging Face's ``tp_plan`` maps module patterns (``layers.*.self_attn.q_proj``)
  to style names (``"colwise"``, ``"rowwise"``, ``"embedding_rowwise"``, ...).

What neither can say is named, per weight, with the reason: transposed
storage, fused sections (a q|k|v projection whose sections each split over
tp), a weight read sharded by another op (a norm over the sharded width,
stacked experts), a parameter that is no module's ``weight``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch.nn as nn

from autoshard.core.sharding import ALL_GATHER, FWD, Role

LINEAR, EMBEDDING = "linear", "embedding"


@dataclasses.dataclass(frozen=True)
class ParallelizePlan:
    """``styles`` for ``parallelize_module(model, tp_mesh, styles)``; ``not_expressed`` maps each
    weight whose autoshard layout those styles do not reproduce to why."""

    styles: Mapping[str, object]
    not_expressed: Mapping[str, str]


def _module_kinds(plan, model: nn.Module | None) -> dict[str, str]:
    """``{weight FQN: "linear" | "embedding"}`` for the weights a module style can own.

    With ``model`` the module types decide. Without it, a parameter named
    ``weight`` is a linear's when the plan stores it transposed or cuts it
    rowwise as the model has it, and an embedding's when it is colwise and kept
    as ``[num, dim]`` (a table is already the ``[in, out]`` form).
    """
    kinds = {}
    for fqn, entry in plan.params.items():
        owner, _, name = fqn.rpartition(".")
        if name != "weight":
            continue
        if model is not None:
            module = model.get_submodule(owner)
            kind = LINEAR if isinstance(module, nn.Linear) else EMBEDDING if isinstance(module, nn.Embedding) else None
        elif entry.role == Role.COLWISE:
            kind = LINEAR if entry.transposed else EMBEDDING
        elif entry.role == Role.ROWWISE:
            kind = None if entry.transposed else LINEAR
        elif entry.role == Role.VOCAB_PARALLEL:
            kind = EMBEDDING
        else:
            kind = None
        if kind is not None:
            kinds[fqn] = kind
    return kinds


def to_parallelize_plan(plan, model: nn.Module | None = None) -> ParallelizePlan:
    """See :mod:`autoshard.plans.export`; the styles' activation layouts are the plan's (a colwise
    output the plan gathers at once is ``output_layouts=Replicate()``)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kinds = _module_kinds(plan, model)
    styles, not_expressed = {}, {}
    for fqn, entry in plan.params.items():
        owner = fqn.rpartition(".")[0]
        role = entry.role
        if role in (Role.REPLICATE, Role.COLWISE_BIAS, Role.ROWWISE_BIAS):
            continue  # replicated, or a bias: it follows its module's style (below)
        if fqn not in kinds:
            not_expressed[fqn] = (
                f"{role}: no nn.Linear or nn.Embedding owns it as 'weight', and a ParallelStyle shards modules"
                if role != Role.SHARDED else "read sharded by an op (no ParallelStyle shards a parameter on its own)"
            )
            continue
        if entry.sections:
            not_expressed[fqn] = (
                f"fused sections [{entry.fused.text()}] each cut over tp"
                + (" (* held whole on every rank)" if entry.whole_sections else "")
                + "; a style cuts the fused dim in contiguous pieces"
            )
            continue
        if role == Role.COLWISE:
            styles[owner] = ColwiseParallel(output_layouts=Replicate()) if _gathered(entry) else ColwiseParallel()
            if entry.transposed:
                not_expressed[fqn] = (
                    "stored transposed [in, out] and cut on dim 1; ColwiseParallel keeps [out, in] cut on "
                    "dim 0 (the same output columns per rank)"
                )
        elif role == Role.ROWWISE:
            styles[owner] = RowwiseParallel()
        elif role == Role.VOCAB_PARALLEL:
            styles[owner] = RowwiseParallel()  # an embedding's rows: the vocabulary
    for fqn, entry in plan.params.items():
        if entry.role in (Role.COLWISE_BIAS, Role.ROWWISE_BIAS):
            owner, _, name = fqn.rpartition(".")
            if name != "bias" or owner not in styles:
                not_expressed[fqn] = "a bias whose weight no style expresses"
    return ParallelizePlan(styles, not_expressed)


def _gathered(entry) -> bool:
    """Whether the plan all-gathers this colwise weight's output right away (no rowwise reads it)."""
    return any(c.kind == ALL_GATHER and c.subject == "output" and c.direction == FWD for c in entry.collectives)


_HF_STYLE = {
    (Role.COLWISE, LINEAR): "colwise",
    (Role.ROWWISE, LINEAR): "rowwise",
    (Role.COLWISE, EMBEDDING): "embedding_colwise",
    (Role.VOCAB_PARALLEL, EMBEDDING): "embedding_rowwise",
}


def to_hf_tp_plan(plan, model: nn.Module | None = None) -> dict[str, str]:
    """``{module pattern: style}``: each repeated block's modules as one ``*`` pattern when every
    block agrees, else one entry per module. Weights with fused sections whose sections are
    equal (gate|up) become ``"packed_colwise"``; what no style says is left out (see
    :func:`to_parallelize_plan`'s ``not_expressed``)."""
    kinds = _module_kinds(plan, model)
    by_module = {}
    for fqn, kind in kinds.items():
        entry = plan.params[fqn]
        style = _HF_STYLE.get((entry.role, kind))
        if style is None:
            continue
        if entry.sections:
            if style != "colwise" or len(set(entry.sections)) != 1 or entry.whole_sections or entry.section_runs:
                continue
            style = "packed_colwise"
        elif style == "colwise" and _gathered(entry):
            style = "colwise_rep"
        by_module[fqn.rpartition(".")[0]] = style
    patterns: dict[str, set[str]] = {}
    for module, style in by_module.items():
        patterns.setdefault(re.sub(r"\.\d+\.", ".*.", module), set()).add(style)
    out = {}
    for module, style in by_module.items():
        pattern = re.sub(r"\.\d+\.", ".*.", module)
        if len(patterns[pattern]) == 1:
            out[pattern] = style
        else:
            out[module] = style
    return out
