"""What to tell a user whose model mixes dtypes under mixed precision.

FSDP2's ``MixedPrecisionPolicy`` casts parameters to ``param_dtype`` and each FSDP unit's floating
inputs to it; buffers stay as they are, and so does a float32 value the forward makes itself (a
``torch.where`` against a float32 scalar tensor, an upcast never cast back). Where such a value
meets a ``param_dtype`` weight, the model's own forward fails, sharded or not. These hints name
where the wide value comes from and the policy's knob that fixes it: ``buffer_dtype`` for a
buffer (FSDP1's), ``output_dtype`` for a value that leaves its block (FSDP2's).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from autoshard.core.errors import describe
from autoshard.plans.block_owners import unit_of_node


def buffer_dtype_hint(model: nn.Module, compute_dtype) -> str:
    """For an error on mixed dtypes under mixed precision: the floating buffers kept in another
    dtype, and what to do. FSDP2 casts parameters and inputs to ``param_dtype`` and leaves buffers
    as they are, so a float32 buffer (a rotary or scale table) turns bf16 math float32 part-way."""
    if compute_dtype is None or compute_dtype == torch.float32:
        return ""
    kept = [name for name, b in model.named_buffers() if b.is_floating_point() and b.dtype != compute_dtype]
    if not kept:
        return ""
    shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
    return (f". Under mp_policy the parameters and inputs compute in {compute_dtype} and the buffers stay as "
            f"they are, as FSDP2 runs them; this model keeps {shown} in another dtype. Pass "
            f"buffer_dtype={compute_dtype} (as FSDP1's MixedPrecision did), or compute where they are read in an "
            f"autocast(enabled=False) region")


def widened_value_hint(failing: fx.Node | None, compute_dtype, block_fqns) -> str:
    """For ``failing``, an op that raised on mixed dtypes: where its wider floating operand was
    made, and the fix. The wide value is followed back through the ops that computed it to the
    one that made it wide: an upcast (``.float()``), or an op whose other wide operands are
    constants (``torch.where(mask, x, torch.tensor(0.))``). A value made in a block and read
    outside it is cast by ``output_dtype``."""
    if failing is None or compute_dtype is None or torch.finfo(compute_dtype).bits >= 32:
        return ""
    constant: dict[fx.Node, bool] = {}
    computed = [a for a in failing.all_input_nodes
                if _floating_wider(a, compute_dtype) and not _made_of_constants(a, constant)]
    if not computed:
        return ""
    origin = computed[0]
    while True:
        wider = [a for a in origin.all_input_nodes
                 if _floating_wider(a, compute_dtype) and not _made_of_constants(a, constant)]
        if not wider:
            break
        origin = wider[0]
    if origin.op != "call_function":  # an input left uncast (cast_forward_inputs=False): the user's own
        return ""
    dtype = str(origin.meta["val"].dtype).removeprefix("torch.")
    narrow = str(compute_dtype).removeprefix("torch.")
    made_in, read_in = unit_of_node(origin, block_fqns), unit_of_node(failing, block_fqns)
    where = f" (in block '{made_in}')" if made_in else ""
    hint = f". Its {dtype} operand is made {dtype} by {describe(origin)}{where} from {narrow} values and constants"
    if made_in and made_in != read_in:
        return (f"{hint}, and leaves its block so, as FSDP2 runs it too. Pass mp_policy with "
                f"output_dtype={compute_dtype} (FSDP2 then casts each block's outputs), or cast it back "
                f"where it is made")
    return f"{hint}, as FSDP2 runs it too. Cast it back to {compute_dtype} where it is made"


def _made_of_constants(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """Whether ``node`` is computed from constants only: tensors the code makes (a lifted
    ``torch.tensor(0.)``, an ``arange``) or buffers, never a parameter or an input."""
    if node not in memo:
        if node.op == "get_attr":
            memo[node] = not _is_parameter(node)
        elif node.op == "call_function":
            memo[node] = all(_made_of_constants(a, memo) for a in node.all_input_nodes)
        else:
            memo[node] = False
    return memo[node]


def _is_parameter(node: fx.Node) -> bool:
    try:
        node.graph.owning_module.get_parameter(node.target)
    except AttributeError:
        return False
    return True


def _floating_wider(node: fx.Node, dtype: torch.dtype) -> bool:
    val = node.meta.get("val")
    return (isinstance(val, torch.Tensor) and val.is_floating_point()
            and torch.finfo(val.dtype).bits > torch.finfo(dtype).bits)
