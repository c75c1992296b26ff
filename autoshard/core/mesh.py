"""Read the user's DeviceMesh into the axes autoshard knows.

Four kinds of axis: ``pp`` (pipeline stages, outermost: each pp coordinate runs
its stages on the ``dp x tp`` sub-mesh below it, see :mod:`autoshard.runtime.pipeline_stages`),
``tp`` (tensor parallel), the FSDP axis that shards parameters (``dp``, or
``dp_shard`` under HSDP) and, under HSDP, ``dp_replicate``, over which every FSDP shard is replicated and gradients are
all-reduced after the reduce-scatter. The names are torchtitan's, so a mesh
built for a torchtitan job is accepted as it is. Planning needs only the
shard axis and tp: a plan's per-parameter dp choice (``S(0)``, ``S(1)`` or
``R``) is made on the shard axis and ``dp_replicate`` is always ``R``.
"""

from __future__ import annotations

import dataclasses
import math

from torch.distributed.device_mesh import DeviceMesh

DP, TP = "dp", "tp"
DP_REPLICATE, DP_SHARD = "dp_replicate", "dp_shard"
PP = "pp"
CP = "cp"
EP = "ep"

# The axes, outer to inner (torchtitan's order: pipeline stages outermost, data parallel outside
# context parallel, tp innermost, as FSDP2 composes with tp). A mesh names any of them in this order
# (see :func:`accepted`): the shapes follow from the order, not from a list.
_ORDER = (PP, DP_REPLICATE, DP_SHARD, DP, EP, CP, TP)


def accepted(names: tuple[str, ...]) -> bool:
    """Whether axes ``names`` form a mesh autoshard shards: known axes, each once, in :data:`_ORDER`;
    one data-parallel form (``dp``, or HSDP's ``dp_replicate`` and ``dp_shard`` together)."""
    if not names or len(set(names)) != len(names) or any(a not in _ORDER for a in names):
        return False
    if list(names) != sorted(names, key=_ORDER.index):
        return False
    hsdp = {DP_REPLICATE, DP_SHARD} & set(names)
    return not (hsdp and (DP in names or len(hsdp) == 1))


def _subsequences(order):
    out = [()]
    for axis in order:
        out += [s + (axis,) for s in out]
    return out


MESH_SHAPES = tuple(s for s in _subsequences(_ORDER) if accepted(s))

# axes the order allows together that are not built yet, and why (docs/limits.md lists them); every
# combination the order allows is built today, so a new axis adds its gaps here until it composes
NOT_YET: dict[frozenset, str] = {}


def refuse_not_yet(names) -> None:
    """Raise ``NotImplementedError`` for a combination of axes :data:`NOT_YET` lists."""
    for axes, why in NOT_YET.items():
        if axes <= set(names):
            raise NotImplementedError(f"autoshard: {why}")


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The mesh axes autoshard uses, in mesh order, with their sizes.

    ``mesh`` is ``None`` when only sizes are known (planning-only tests, or
    checking a saved plan's mesh dict).
    """

    sizes: tuple[tuple[str, int], ...]
    mesh: DeviceMesh | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.sizes)

    def size(self, axis: str) -> int:
        return dict(self.sizes).get(axis, 1)

    @property
    def shard_axis(self) -> str | None:
        """The axis FSDP2 shards parameters over: ``dp_shard`` under HSDP, else ``dp``; on a mesh
        with a cp axis FSDP shards over it too (:attr:`fsdp_axes`), and over it alone without dp."""
        return self.fsdp_axes[0] if self.fsdp_axes else None

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """The axes FSDP2 shards parameters over, flattened into one: the shard axis, ep (whose
        ranks are data ranks for every weight but the experts') and cp (whose ranks hold the same
        parameters and sum their gradients, as torchtitan's ``dp_shard_cp``)."""
        return tuple(a for a in (DP_SHARD, DP, EP, CP) if a in self.names)

    @property
    def expert_fsdp_axes(self) -> tuple[str, ...]:
        """The axes FSDP2 shards the experts' weights over under expert parallelism: the data
        axes ep does not take (the experts themselves are cut over ep)."""
        return tuple(a for a in self.fsdp_axes if a != EP)

    @property
    def dp_axes(self) -> tuple[str, ...]:
        """Every data-parallel axis, outer first: ``("dp_replicate", "dp_shard")``, ``("dp",)``,
        with ``ep`` (each ep rank routes its own batch's tokens). cp is none: its ranks take the
        same batch."""
        return tuple(a for a in self.names if a not in (TP, PP, CP))

    @property
    def ep(self) -> int:
        """Expert-parallel ranks, which hold disjoint experts (1 without an ep axis)."""
        return self.size(EP)

    @property
    def has_ep(self) -> bool:
        return EP in self.names

    @property
    def cp(self) -> int:
        """Context-parallel ranks, which cut the sequence (1 without a cp axis)."""
        return self.size(CP)

    @property
    def has_cp(self) -> bool:
        return CP in self.names

    @property
    def pp(self) -> int:
        """Pipeline stages' ranks (1 without a pp axis)."""
        return self.size(PP)

    @property
    def has_pp(self) -> bool:
        return PP in self.names

    def stage_axes(self) -> MeshAxes:
        """The axes one pipeline stage is sharded over: these axes without ``pp``, on this rank's
        ``dp x tp`` sub-mesh (the axes themselves without a pp axis). A pp-only mesh's stages run
        whole, on one rank: no axis left."""
        if not self.has_pp:
            return self
        sizes = tuple((a, n) for a, n in self.sizes if a != PP)
        mesh = self.mesh[tuple(a for a, _ in sizes)] if self.mesh is not None and sizes else None
        return MeshAxes(sizes, mesh)

    @property
    def fsdp_degree(self) -> int:
        """How many shards FSDP cuts each parameter into (what padding and a shard's size depend on):
        the product of :attr:`fsdp_axes`, so ``dp x ep x cp`` where the mesh has them, not ``dp`` alone."""
        return math.prod(self.size(axis) for axis in self.fsdp_axes)

    @property
    def replicas(self) -> int:
        """How many replicas of each FSDP shard there are (``dp_replicate``; 1 without HSDP)."""
        return self.size(DP_REPLICATE)

    @property
    def data_parallel(self) -> int:
        """Ranks that see different batches: ``dp_replicate * dp_shard`` (or ``dp``), times ``ep``."""
        return self.size(DP) * self.size(DP_SHARD) * self.replicas * self.ep

    @property
    def tp(self) -> int:
        return self.size(TP)

    @property
    def has_tp(self) -> bool:
        return TP in self.names

    @property
    def has_dp(self) -> bool:
        return self.shard_axis is not None

    @property
    def is_hsdp(self) -> bool:
        return DP_REPLICATE in self.names

    def submesh(self, axis: str) -> DeviceMesh:
        assert self.mesh is not None, "planning-only MeshAxes has no DeviceMesh"
        return self.mesh if self.mesh.ndim == 1 else self.mesh[axis]

    def dp_mesh(self) -> DeviceMesh:
        """The mesh ``fully_shard`` takes: 1-D for FSDP, 2-D ``(dp_replicate, dp_shard)`` for HSDP;
        with a cp or ep axis the shard axis and those flattened into one (``dp_cp``, ``dp_ep``,
        ``dp_shard_cp``)."""
        assert self.mesh is not None, "planning-only MeshAxes has no DeviceMesh"
        if len(self.fsdp_axes) > 1:
            name = "_".join(self.fsdp_axes)
            flat = self.mesh[self.fsdp_axes]._flatten(name)
            return self.mesh[(DP_REPLICATE, name)] if self.is_hsdp else flat
        if self.has_cp or self.has_ep:
            return self.mesh[self.fsdp_axes]
        return self.mesh if self.mesh.ndim == len(self.dp_axes) else self.mesh[self.dp_axes]

    def expert_dp_mesh(self) -> DeviceMesh | None:
        """The mesh ``fully_shard`` takes for the experts' weights under expert parallelism: the
        data axes ep leaves (:attr:`expert_fsdp_axes`), or None when ep takes them all."""
        assert self.mesh is not None, "planning-only MeshAxes has no DeviceMesh"
        axes = self.expert_fsdp_axes
        if not axes:
            return None
        if len(axes) > 1:
            flat = self.mesh[axes]._flatten("_".join(axes))
            return self.mesh[(DP_REPLICATE, flat.mesh_dim_names[0])] if self.is_hsdp else flat
        return self.mesh[(DP_REPLICATE, axes[0])] if self.is_hsdp else self.mesh[axes[0]]

    def expert_dp_groups(self) -> tuple:
        """The process groups the gradient of an expert kept whole over the data axes ep leaves is
        averaged over, inner first (under HSDP: dp_shard, then dp_replicate)."""
        mesh = self.expert_dp_mesh()
        if mesh is None:
            return ()
        return tuple(mesh.get_group(i) for i in reversed(range(mesh.ndim)))

    def dp_groups(self) -> tuple:
        """The process groups a gradient FSDP2 ignores is averaged over, inner first (FSDP2's order)."""
        mesh = self.dp_mesh()
        if mesh.ndim == 1:
            return (mesh.get_group(),)
        return tuple(mesh.get_group(i) for i in reversed(range(mesh.ndim)))

    def group_name(self, axis: str) -> str:
        return self.submesh(axis).get_group().group_name

    def to_dict(self) -> dict[str, int]:
        return dict(self.sizes)


def dp_choice(placements) -> str | None:
    """A plan entry's placement on the FSDP shard axis (``dp`` or ``dp_shard``), if it has one."""
    return placements.get(DP, placements.get(DP_SHARD, placements.get(EP, placements.get(CP))))


def read_mesh(mesh: DeviceMesh) -> MeshAxes:
    """Validate ``mesh`` and return its axes (one of :data:`MESH_SHAPES`)."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"autoshard: `mesh` must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if not accepted(names):
        raise ValueError(
            f"autoshard: mesh axes must be named ('dp', 'tp') (dp outer), ('dp',) or ('tp',), or for HSDP "
            f"('dp_replicate', 'dp_shard', 'tp') or ('dp_replicate', 'dp_shard'), each with 'pp' in front for "
            f"pipeline stages (or ('pp',) alone), with 'ep' after the data axes for expert parallelism "
            f"(('dp', 'ep', 'tp'), ('ep',), ...), or with 'cp' before 'tp' for context parallelism "
            f"(('dp', 'cp', 'tp'), ('cp',), ...); got mesh_dim_names={names or None} with shape "
            f"{tuple(mesh.shape)}. Create it with init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))."
        )
    refuse_not_yet(names)
    return MeshAxes(tuple(zip(names, (int(n) for n in mesh.shape), strict=True)), mesh)


def axes_from_sizes(sizes: dict[str, int]) -> MeshAxes:
    """The axes of a mesh given by sizes only (``{"dp": 2, "tp": 2}``), in mesh order."""
    order = tuple(a for a in _ORDER if a in sizes)
    unknown = sorted(set(sizes) - set(_ORDER))
    if unknown or not accepted(order):
        what = f"unknown mesh axes {unknown}" if unknown else f"mesh axes {sorted(sizes)} do not go together"
        raise ValueError(
            f"autoshard: {what}; expected 'dp' and/or 'tp', or 'dp_replicate' and 'dp_shard' (HSDP) "
            "with or without 'tp', each with or without 'pp', 'ep' (expert parallelism) after the data axes, or "
            "'cp' (context parallelism) before 'tp'"
        )
    refuse_not_yet(order)
    return MeshAxes(tuple((a, int(sizes[a])) for a in order))


def data_parallel_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """``(index, count)``: which of ``count`` data-parallel batches this rank takes.

    Ranks that differ only in ``tp`` or ``pp`` take the same batch; under HSDP the index
    runs over ``(dp_replicate, dp_shard)`` coordinates, replicate outer. A
    tp-only mesh has one batch.

    Args:
        mesh: the mesh the model is sharded over (as given to :func:`autoshard.autoshard`).
    """
    axes = read_mesh(mesh)
    index = 0
    for axis in axes.dp_axes:
        index = index * axes.size(axis) + mesh.get_local_rank(axis)
    return index, axes.data_parallel
