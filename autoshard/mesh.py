"""Read the user's DeviceMesh into the two axes autoshard knows: ``dp`` and ``tp``."""

from __future__ import annotations

import dataclasses

from torch.distributed.device_mesh import DeviceMesh

DP, TP = "dp", "tp"


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
    def dp(self) -> int:
        return self.size(DP)

    @property
    def tp(self) -> int:
        return self.size(TP)

    @property
    def has_tp(self) -> bool:
        return TP in self.names

    @property
    def has_dp(self) -> bool:
        return DP in self.names

    def submesh(self, axis: str) -> DeviceMesh:
        assert self.mesh is not None, "planning-only MeshAxes has no DeviceMesh"
        return self.mesh if self.mesh.ndim == 1 else self.mesh[axis]

    def group_name(self, axis: str) -> str:
        return self.submesh(axis).get_group().group_name

    def to_dict(self) -> dict[str, int]:
        return dict(self.sizes)


def read_mesh(mesh: DeviceMesh) -> MeshAxes:
    """Validate ``mesh`` and return its axes.

    Accepted: a 2-D mesh named ``("dp", "tp")`` (dp outer, as FSDP2 composes with
    TP), or a 1-D mesh named ``("dp",)`` or ``("tp",)``.
    """
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"autoshard: `mesh` must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if names not in ((DP, TP), (DP,), (TP,)):
        raise ValueError(
            f"autoshard: mesh axes must be named ('dp', 'tp') (dp outer), ('dp',) or ('tp',); "
            f"got mesh_dim_names={names or None} with shape {tuple(mesh.shape)}. "
            "Create it with init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))."
        )
    return MeshAxes(tuple(zip(names, (int(n) for n in mesh.shape), strict=True)), mesh)


def axes_from_sizes(sizes: dict[str, int]) -> MeshAxes:
    unknown = set(sizes) - {DP, TP}
    if unknown:
        raise ValueError(f"autoshard: unknown mesh axes {sorted(unknown)}; expected 'dp' and/or 'tp'")
    order = [a for a in (DP, TP) if a in sizes]
    return MeshAxes(tuple((a, int(sizes[a])) for a in order))
