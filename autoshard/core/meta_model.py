"""Whether a model was built on the meta device: asked by capture, the door and materialization."""

from __future__ import annotations

import torch.nn as nn


def parameters_on_meta(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device: all its parameters there, or none.

    A model with some parameters on meta and others holding values is refused:
    it can be neither traced on one device nor materialized as one unit.
    """
    on_meta = {name: p.is_meta for name, p in model.named_parameters()}
    if all(on_meta.values()) != any(on_meta.values()):
        meta = next(n for n, m in on_meta.items() if m)
        real = next(n for n, m in on_meta.items() if not m)
        raise ValueError(
            f"autoshard: parameter '{meta}' is on the meta device but '{real}' is on "
            f"{model.get_parameter(real).device}; build the whole model on meta (its values then come from "
            f"load_state_dict after sharding) or none of it"
        )
    return any(on_meta.values())
