"""Agreement: every rank must have planned the same model for the same inputs.

Each rank captures and plans on its own, with no communication. If one rank's
model differs (it built a narrower MLP, loaded another config) or it was given
inputs of another shape, the first collective that follows (the broadcast of
rank 0's weights, FSDP's first all-gather) gets mismatched sizes: gloo aborts the
process, NCCL hangs. So before any collective, the ranks exchange a digest of
their plan, input signature and emitted code (one ``all_gather_object`` of a
few bytes) and, when they differ, exchange the summaries behind them; every
rank then raises the same ``ValueError`` naming the ranks that differ and the
first parameter, input or line of code where they do.

The code is compared too because equal placements do not make equal
collectives: where a partial sum is reduced (before or after a cast), or in
what order, is in the code alone, and ranks that emit it differently abort in
gloo on mismatched sizes. Each rank's own group names (the tp group of ranks
{0, 1} and that of {2, 3} are named apart) are written as their axis first.
"""

from __future__ import annotations

import hashlib
import json
import re

import torch.distributed as dist

from autoshard.core.sharding import placements_text
from autoshard.passes.capture import InputSignature
from autoshard.plans.plan import Plan


def summary(plan: Plan, inputs: InputSignature, code: tuple[str, ...] = ()) -> dict:
    """What every rank must agree on: each parameter's role, shape and placements, each
    input's name, shape and dtype, in order, and the lines of the emitted code."""
    return {
        "params": [[fqn, str(p.role), list(p.shape), placements_text(p.placements)] for fqn, p in plan.params.items()],
        "inputs": [[name, [None if n is None else int(n) for n in shape], str(dtype)]
                   for name, shape, dtype in inputs.tensors],
        "code": list(code),
    }


def code_lines(codes: list[str], group_names: dict[str, str]) -> tuple[str, ...]:
    """The emitted code as every rank of the mesh writes it: each process group's name
    (``'4'``) replaced by its axis (``'<tp>'``)."""
    if not group_names:
        return tuple(line for code in codes for line in code.splitlines())
    names = re.compile("|".join(re.escape(repr(name)) for name in sorted(group_names, key=len, reverse=True)))
    by_repr = {repr(name): f"'<{axis}>'" for name, axis in group_names.items()}
    return tuple(names.sub(lambda m: by_repr[m.group(0)], line) for code in codes for line in code.splitlines())


def check_ranks_agree(plan: Plan, inputs: InputSignature, group=None, code: tuple[str, ...] = ()) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` when their plans, inputs or
    emitted code (:func:`code_lines`) differ."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = summary(plan, inputs, code)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()
    digests: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)  # a few bytes per rank
    if len(set(digests)) == 1:
        return
    gathered: list = [None] * len(digests)
    dist.all_gather_object(gathered, (digest, mine), group=group)  # only to name the difference
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(gathered)))
    reference = max(set(digests), key=lambda d: (digests.count(d), -digests.index(d)))  # most ranks, then lowest
    same = [r for r, d in zip(ranks, digests, strict=True) if d == reference]
    first_other = next(i for i, d in enumerate(digests) if d != reference)
    differ = [r for r, d in zip(ranks, digests, strict=True) if d != reference]
    where = _first_difference(gathered[digests.index(reference)][1], gathered[first_other][1])
    raise ValueError(
        f"autoshard: ranks disagree on the model or its inputs: rank(s) {differ} differ from rank(s) {same}; "
        f"first difference, rank {same[0]} vs rank {ranks[first_other]}: {where}. Every rank must build the "
        f"same model and feed example inputs of the same shapes"
    )


def _first_difference(a: dict, b: dict) -> str:
    for kind, noun in (("params", "parameter"), ("inputs", "input")):
        left, right = a[kind], b[kind]
        for x, y in zip(left, right, strict=False):
            if x != y:
                return f"{noun} '{x[0]}' is {_describe(x)} vs {_describe(y)}" if x[0] == y[0] else (
                    f"{noun} '{x[0]}' vs '{y[0]}' at the same position")
        if len(left) != len(right):
            extra = (left if len(left) > len(right) else right)[min(len(left), len(right))]
            return f"{len(left)} vs {len(right)} {noun}s (first unmatched: '{extra[0]}')"
    for number, (x, y) in enumerate(zip(a["code"], b["code"], strict=False), start=1):
        if x != y:
            return (f"the emitted code differs at line {number}: {x.strip()!r} vs {y.strip()!r} (the same parameters "
                    f"and inputs planned into other collectives: the model's code differs between ranks, or "
                    f"autoshard planned by something other than the model, a defect to report)")
    if len(a["code"]) != len(b["code"]):
        return f"the emitted code differs: {len(a['code'])} vs {len(b['code'])} lines"
    return "the plans differ"


def _describe(entry: list) -> str:
    if len(entry) == 4:  # a parameter
        _, role, shape, placements = entry
        return f"{role} of shape {shape} placed {placements}"
    _, shape, dtype = entry
    return f"of shape {shape} and dtype {dtype}"


def check_agreement(final_plan: Plan, inputs: InputSignature, axes, parts=None) -> None:
    """All ranks of the mesh planned alike (and, given ``parts``, emitted the same code), or all
    raise the same ``ValueError``. Over the default group when the mesh spans it; else per mesh
    axis (a rank that differs shares an axis group with one that does not, so the check still
    fires, on those groups' ranks)."""
    mesh = axes.mesh
    code = ()
    if parts is not None:
        names = {mesh.get_group(axis).group_name: axis for axis in mesh.mesh_dim_names}
        code = code_lines([parts.root.code] + [parts.blocks[b].code for b in sorted(parts.blocks)], names)
    if mesh.size() == dist.get_world_size():
        check_ranks_agree(final_plan, inputs, code=code)
        return
    for name in mesh.mesh_dim_names:
        check_ranks_agree(final_plan, inputs, mesh.get_group(name), code=code)
