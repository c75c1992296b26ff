"""Properties every plan must have, checked on the plans of the pattern models and the zoo sample."""

from __future__ import annotations

from torch.distributed.tensor import Replicate

from autoshard.plans.plan import Plan


def assert_breaks_complete(plan: Plan) -> None:
    """No block may claim to be tensor parallel while a weight of it is whole over tp: each block
    parameter of 2 or more dims replicated over tp is a break of its block (named in
    ``plan.breaks``) or replicated by choice, with the reason in its entry."""
    if "tp" not in plan.mesh:
        return
    named = {(unit, where.split("'")[1]) for unit, where in plan.breaks if where.startswith("'")}
    for fqn, entry in plan.params.items():
        if not entry.unit or len(entry.shape) < 2 or entry.placements["tp"] != Replicate():
            continue
        by_choice = entry.why.computed_whole or entry.why.read_whole
        assert by_choice or (entry.unit, fqn) in named, (
            f"'{fqn}' of {entry.unit} is replicated over tp, but neither a break nor replicated by choice: "
            f"{plan.breaks_line()}"
        )
        assert not (by_choice and (entry.unit, fqn) in named), f"'{fqn}' is both a break and a choice"
