"""Meshes as a test or a command line writes them: ``{"dp": 2, "tp": 4}`` or ``"dp=2,tp=4"``."""

from __future__ import annotations


def parse_mesh(mesh) -> dict[str, int]:
    """``{"dp": 2, "tp": 4}`` from that dict or from ``"dp=2,tp=4"``."""
    if isinstance(mesh, str):
        try:
            pairs = [part.split("=") for part in mesh.replace(" ", "").split(",") if part]
            mesh = {axis: int(size) for axis, size in pairs}
        except ValueError:
            raise ValueError(f"autoshard: a mesh is written 'dp=2,tp=4', got {mesh!r}") from None
    if not isinstance(mesh, dict) or not mesh or not all(
            isinstance(k, str) and isinstance(v, int) and v > 0 for k, v in mesh.items()):
        raise ValueError(
            f"autoshard: a mesh is a dict of positive axis sizes such as {{'dp': 2, 'tp': 4}}, got {mesh!r}")
    return dict(mesh)


def mesh_text(mesh: dict[str, int]) -> str:
    """A mesh as the plan's header writes it: ``dp=2 x tp=4``."""
    return " x ".join(f"{axis}={size}" for axis, size in mesh.items())


def mesh_id(mesh: dict[str, int]) -> str:
    """The test id of a mesh: ``dp2-tp4``."""
    return "-".join(f"{axis}{size}" for axis, size in mesh.items())
