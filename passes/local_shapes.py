"""Local shapes: the values of a cut graph at the shapes one rank holds.

Every rule of the cut reads whole shapes; once the walk is done, fake-tensor propagation gives
every value its local shape. A view the local layout cannot take becomes a reshape there. An op of
the model that torch refuses on the local shapes is named by its node and source line; a failure at
a node the cut inserted, or one that is no refusal of torch's, is an :class:`InternalError`.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autoshard.core.errors import describe
from autoshard.passes.cp_errors import first_line, reraise, unexpected
from autoshard.passes.position_tables import _causal_mask, _merged_index
from autoshard.passes.sequence_ops import val_of

aten = torch.ops.aten


def refresh_shapes(gm: fx.GraphModule, inserted=frozenset()) -> None:
    """Every node's ``meta["val"]`` recomputed (fake tensors) for the rewritten, local shapes.

    A view of a value whose local layout cannot be viewed so (a ``transpose(1, 2).contiguous().view(b,
    s, -1)`` whose ``contiguous`` export dropped, since the op it followed made the transpose
    contiguous, an op the cut replaced, which does not) becomes a reshape: a view where it can be
    one, a copy where it cannot. An op that fails on the local shapes raises a ``NotImplementedError``
    naming it and its source line; a failure at a node the cut inserted (``inserted``, or an autoshard
    op), or one that is no error of torch's about the op's arguments, is an :class:`InternalError`."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        vals = [n.meta.get("val") for n in placeholders]
        mode = detect_fake_mode(vals) or FakeTensorMode(allow_non_fake_inputs=True)
        mode.allow_non_fake_inputs = True
        attrs = {n: n.meta["val"] for n in gm.graph.nodes if n.op == "get_attr" and "val" in n.meta}
        prop = _LocalShapes(gm, mode, inserted)
        prop.propagate_dont_convert_inputs(*vals)
    except Exception as err:  # named at its node by _LocalShapes, or outside any node: the propagation itself
        reraise(err, None)
    if prop.reshaped:
        gm.recompile()
    for node, val in attrs.items():  # parameters keep their shapes, and the requires_grad FakeTensorProp drops
        node.meta["val"] = val


_RESHAPED = {aten.view.default: aten.reshape.default, aten._unsafe_view.default: aten.reshape.default}


class _LocalShapes(FakeTensorProp):
    """:class:`FakeTensorProp` that makes views reshapes where the local layout asks for it, and
    names the node at which an op fails."""

    def __init__(self, gm: fx.GraphModule, mode, inserted):
        super().__init__(gm, mode)
        self.extra_traceback = False  # errors are named below, not extended with torch's note
        self.inserted = inserted
        self.reshaped: list[fx.Node] = []

    def run_node(self, n: fx.Node):
        try:
            return super().run_node(n)
        except Exception as err:
            if n.op == "call_function" and n.target in _RESHAPED and isinstance(err, (RuntimeError, ValueError)):
                view = n.target
                n.target = _RESHAPED[view]  # not viewable on the local layout: a reshape copies
                try:
                    result = super().run_node(n)
                except Exception:
                    n.target = view
                else:
                    self.reshaped.append(n)
                    return result
            failure = self._failure(n, err)
            if failure is err:
                raise
            raise failure from err

    def _failure(self, n: fx.Node, err: Exception) -> Exception:
        ours = (n in self.inserted or n.op != "call_function" or n.target in (_merged_index, _causal_mask)
                or getattr(n.target, "namespace", None) == "autoshard")
        if ours or not isinstance(err, (RuntimeError, ValueError, IndexError)):
            return unexpected(err, n)
        inputs = ", ".join(f"'{a.name}' {list(val_of(a).shape)}" for a in n.all_input_nodes
                           if isinstance(val_of(a), torch.Tensor))
        return NotImplementedError(f"autoshard: context parallelism cannot run {describe(n)} on this rank's part "
                                   f"of the sequence (local inputs: {inputs or 'none'}): {type(err).__name__}: "
                                   f"{first_line(err)}")
