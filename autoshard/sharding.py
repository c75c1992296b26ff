"""The sharding vocabulary: parameter roles and the placements each role gives.

One module, imported by the planner's passes, the :class:`~autoshard.plan.Plan`
and retargeting alike, and importing none of them: a role is a
:class:`Role` (a ``str`` enum, so plans print and serialize as before), and
the placements of a parameter follow from its role, its shape and the mesh
(:func:`param_placements`). Activation layouts are DTensor placements
(``passes.layout_rules``); tp collectives are described per parameter in the
plan.
"""

from __future__ import annotations

import enum

from autoshard.mesh import DP, TP, MeshAxes


class Role(enum.StrEnum):
    """How tp treats a parameter (see :mod:`autoshard.plan` for each role's storage)."""

    COLWISE = "colwise"
    ROWWISE = "rowwise"
    COLWISE_BIAS = "colwise_bias"
    ROWWISE_BIAS = "rowwise_bias"
    VOCAB_PARALLEL = "vocab_parallel"
    SHARDED = "sharded"  # the tp dim is given per parameter (its placement): norms, expert weights
    REPLICATE = "replicate"

    def __repr__(self) -> str:
        return repr(self.value)  # messages and reprs read as the plan's JSON does


# The stored dim tp cuts, per role: every linear weight and embedding table is an
# [in, out] / [out, in] block cut on dim 1; a colwise bias and a vocabulary-parallel
# table on dim 0; the rest is replicated over tp. ``sharded`` names its dim per parameter.
TP_DIM_BY_ROLE: dict[Role, int | None] = {
    Role.COLWISE: 1,
    Role.ROWWISE: 1,
    Role.COLWISE_BIAS: 0,
    Role.ROWWISE_BIAS: None,
    Role.VOCAB_PARALLEL: 0,
    Role.REPLICATE: None,
}

# Opens the note of a colwise output gathered right away (tp-only; retargeting drops it without tp).
GATHERED_EARLY = "output all-gathered at once: "


def default_dp_placement(role: str, shape, tp_dim: int | None = None) -> str:
    """FSDP shards dim 0, except a colwise bias (already cut by tp) and scalars stay
    replicated, a vocabulary-parallel table gives dim 0 to tp and dim 1 to FSDP, and a
    ``sharded`` parameter whose dim 0 tp cuts gives FSDP dim 1."""
    if role == Role.VOCAB_PARALLEL:
        return "S(1)"
    if role == Role.SHARDED:
        return "R" if len(shape) <= 1 else "S(1)" if tp_dim == 0 else "S(0)"
    return "R" if role == Role.COLWISE_BIAS or not shape else "S(0)"


def param_placements(
    role: str, shape, axes: MeshAxes, dp_placement: str | None = None, tp_dim: int | None = None
) -> dict[str, str]:
    """Placements per mesh axis of a parameter with ``role`` (``dp_placement`` overrides dp's;
    ``tp_dim`` is the dim tp cuts for role ``sharded``, fixed by the role otherwise)."""
    placements = {}
    if role != Role.SHARDED:
        tp_dim = TP_DIM_BY_ROLE[Role(role)]
    if axes.has_dp:
        placements[DP] = dp_placement or default_dp_placement(role, shape, tp_dim)
    if axes.has_tp:
        placements[TP] = "R" if tp_dim is None else f"S({tp_dim})"
    return placements


def tp_dim_of(entry) -> int | None:
    """The stored dim tp cuts for a plan entry (anything with ``role`` and ``placements``)."""
    if entry.role == Role.SHARDED:
        text = entry.placements.get(TP, "R")
        return None if text == "R" else int(text[2:-1])
    return TP_DIM_BY_ROLE[Role(entry.role)]


def dp_padding(shape, transposed: bool, dp_placement: str | None, dp: int) -> str:
    """Say so when FSDP2 must pad: the dp-sharded stored dim does not divide by dp."""
    if dp_placement is None or dp_placement == "R" or dp <= 1:
        return ""
    dim = int(dp_placement[2:-1])
    stored = tuple(reversed(shape)) if transposed else tuple(shape)
    if len(stored) <= dim or stored[dim] % dp == 0:
        return ""
    return f"stored dim {dim} ({stored[dim]}) does not divide by dp={dp}: FSDP2 pads the last shard"
