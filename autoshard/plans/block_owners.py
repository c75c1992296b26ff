"""Which block owns a module path, and which FSDP unit computes a graph node.

Blocks are named by their module FQNs (``layers.0``); a path belongs to the first of them that is
the path or a dotted prefix of it. The plan's stage costs, the passes and the compile adapter all
ask, so the answer lives at the plan layer, below all of them.
"""

from __future__ import annotations

import functools

import torch.fx as fx


def owner_block(path: str, block_fqns) -> str | None:
    """The block of ``block_fqns`` that ``path`` (a module or parameter FQN) is in, or None.

    The first of ``block_fqns`` that is ``path`` or a dotted prefix of it; found by looking
    ``path``'s prefixes up, so a node's owner costs the same however many blocks there are.
    """
    positions = _positions(tuple(block_fqns))
    candidates = [path[:i] for i, char in enumerate(path) if char == "."]
    candidates.append(path)
    found = [(positions[c], c) for c in candidates if c in positions]
    return min(found)[1] if found else None


@functools.lru_cache(maxsize=32)
def _positions(block_fqns: tuple[str, ...]) -> dict[str, int]:
    """Each block's first position in ``block_fqns``."""
    positions: dict[str, int] = {}
    for i, block in enumerate(block_fqns):
        positions.setdefault(block, i)
    return positions


def unit_of_node(node: fx.Node, block_fqns) -> str:
    """The FSDP unit (block FQN, ``""`` for the root) whose code computes ``node``."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        found = owner_block(path, block_fqns)
        if found:
            return found
    return ""


class BlockOwners:
    """:func:`owner_block` and :func:`unit_of_node` for one tuple of blocks, each module path looked
    up once: a graph's nodes share a few paths per module, and a deep model has many nodes."""

    def __init__(self, block_fqns):
        self.block_fqns = tuple(block_fqns)
        self.found: dict[str, str] = {}

    def of_path(self, path: str) -> str:
        """The block ``path`` is in, or ``""``."""
        if path not in self.found:
            self.found[path] = owner_block(path, self.block_fqns) or ""
        return self.found[path]

    def of_node(self, node: fx.Node) -> str:
        """The unit whose code computes ``node`` (see :func:`unit_of_node`)."""
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            found = self.of_path(path)
            if found:
                return found
        return ""
