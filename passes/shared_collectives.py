"""Shared collectives: one collective where a walk put one per reader.

A walk decides each use of a value on its own, so a value read by several consumers can get
the same collective several times: a gather whole beside a gather for colwise linears, a cut
per view of one replicated value, an ``enter_tp`` per piece of a split. Once the walk is done,
the plan's edges are rewritten so that one collective serves them all (a gather shared, a cut
or an ``enter_tp`` moved up to a common source), each move exact and kept only where it saves
collectives.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.passes import layout_rules
from autoshard.passes.gradient_flow import SHAPED_LIKE, VIEWS
from autoshard.passes.layout_plan import (
    ENTER_ONLY,
    ENTER_TP,
    GATHER,
    GATHER_FOR_COLWISE,
    TAKE_SHARD,
    Redistribute,
    is_sharded,
)
from autoshard.passes.op_dims import SIZED_VIEWS, dim_before, ndim_of

_aten = torch.ops.aten


def share_gathers(edges: dict) -> None:
    """A value gathered whole for some readers and gathered for colwise linears by others is
    gathered once: the colwise readers read that gather and enter tp after it (one all-gather
    forward and one all-reduce backward, not a second all-gather and its reduce-scatter). A
    shared layer's first read of a colwise output that the residual add reads too."""
    plain = {(v, steps[0].dim) for (v, _), steps in edges.items() if steps and steps[0].kind == GATHER}
    for (value, consumer), steps in list(edges.items()):
        if steps and steps[0].kind == GATHER_FOR_COLWISE and (value, steps[0].dim) in plain:
            edges[(value, consumer)] = (Redistribute(GATHER, steps[0].dim), Redistribute(ENTER_TP)) + steps[1:]


def hoist_take_shard(edges: dict, layouts: dict, new_args: dict, tp: int) -> None:
    """Cut a replicated value once where its views are cut for several readers.

    A replicated value read through views by several cut ops (a per-head decay ``decay[None, :,
    None]`` multiplying the state at every step of a loop) would take one cut per view, each an
    all-gather of its gradient in backward. Views only move dims, so cutting their source on the
    dim they read cut and running the views on its local share gives each reader the same values:
    one cut, one all-gather of the summed gradient. A product with a fresh tensor on the way (the
    first step's ``decay * zeros``) is cut too, each rank making its share of the zeros. Done for
    the views that serve one such read alone (other readers of the source keep reading it whole),
    when the source's dim divides by tp.
    """
    cut: dict[tuple[fx.Node, int], list[tuple[fx.Node, fx.Node, list]]] = {}
    for (value, consumer), steps in list(edges.items()):
        if len(steps) != 1 or steps[0].kind != TAKE_SHARD or not isinstance(steps[0].dim, int):
            continue
        chain = _views_back(value, steps[0].dim, layouts, tp)
        if chain is not None:
            cut.setdefault(chain[-1], []).append((value, consumer, chain))
    for (node, dim), members in cut.items():
        members = [m for m in members if _only_for(m[2], m[1])]
        if len(members) < 2 or len({chain[-1][1] for _, _, chain in members}) != 1:
            continue
        if layout_rules._shape(node)[dim] % tp:
            continue
        for value, consumer, chain in members:
            del edges[(value, consumer)]
            for view, view_dim in chain[:-1]:
                layouts[view] = view_dim
                if view.target in SIZED_VIEWS:
                    new_args[view] = (view.args[0], layout_rules._local_shape_arg(view.args[1], view_dim, tp),
                                      *view.args[2:])
                fresh = _fresh_operand(view)
                if fresh is not None:  # made as this rank's share
                    at = _FRESH[fresh.target]
                    layouts[fresh] = view_dim
                    new_args[fresh] = (*fresh.args[:at], layout_rules._local_shape_arg(fresh.args[at], view_dim, tp),
                                       *fresh.args[at + 1:])
            edges[(node, chain[-2][0])] = (Redistribute(TAKE_SHARD, dim),)  # the source's reader: its first op


def _only_for(chain: list, consumer: fx.Node) -> bool:
    """Each view of ``chain`` (value first, source last) is read only by the next one, and the value
    only by ``consumer``: cut, they change nothing another reader sees."""
    reader = consumer
    for view, _ in chain[:-1]:
        if set(view.users) != {reader}:
            return False
        reader = view
    return True


_CUT_VIEWS = (_aten.unsqueeze.default, _aten.squeeze.dim, _aten.slice.Tensor, *SIZED_VIEWS)
# fresh tensors made in the forward (a recurrence's zero state): any rank may make its share alone
_FRESH = {_aten.zeros.default: 0, _aten.ones.default: 0, _aten.new_zeros.default: 1, _aten.new_ones.default: 1}


def _views_back(value: fx.Node, dim: int, layouts: dict, tp: int) -> list[tuple[fx.Node, int]] | None:
    """``value`` and the ops back to the replicated value it is made from (the last entry, as
    ``(node, dim)``), each with the dim that is ``dim`` of ``value``: views, and products or sums
    with a fresh tensor of the same shape (a recurrence's first step, ``decay * zeros``), whose
    share each rank makes alone. None when ``value`` is neither."""
    chain, node = [], value
    while node.op == "call_function" and layouts.get(node) is None:
        fresh = _fresh_operand(node)
        if node.target in _CUT_VIEWS and isinstance(node.args[0], fx.Node) and len(node.all_input_nodes) == 1:
            source = node.args[0]
            before = dim_before(node, source, dim, tp)
        elif fresh is not None:
            source = next(a for a in node.args[:2] if a is not fresh)
            before = dim if ndim_of(source) == ndim_of(node) and layout_rules._shape(source)[dim] == \
                layout_rules._shape(node)[dim] else None
        else:
            break
        if before is None:
            return None
        chain.append((node, dim))
        node, dim = source, before
    if not chain or layouts.get(node) is not None:
        return None
    return chain + [(node, dim)]


def _fresh_operand(node: fx.Node) -> fx.Node | None:
    """The fresh tensor (zeros, ones) ``node`` multiplies or adds, of ``node``'s own shape and read by
    it alone, when the other operand is a value; else None."""
    if node.target not in (_aten.mul.Tensor, _aten.add.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    for fresh, other in ((a, b), (b, a)):
        if (isinstance(fresh, fx.Node) and isinstance(other, fx.Node) and fresh.target in _FRESH
                and len(fresh.users) == 1 and layout_rules._shape(fresh) == layout_rules._shape(node)):
            return fresh
    return None


def hoist_enter_tp(edges: dict, layouts: dict, carries_grad: frozenset[fx.Node]) -> None:
    """Move ``enter_tp`` up to where one all-reduce serves several readers.

    Entering tp earlier is exact whenever every gradient reaching the earlier value is partial:
    backward is linear in the gradient it is given, and a replicated computation is the same on
    every rank, so summing over tp before it or after it gives one sum. So ``enter_tp`` may climb
    from a value to an ancestor ``top`` when everything between them is replicated, takes its
    gradient only from ``top`` or from parameters, and is read only by ``enter_tp`` or by itself
    (views, casts, a weightless norm of a split's piece, a LoRA adapter's ``lora_A`` computed
    whole). Those parameters' gradients turn partial too, so they enter tp as well, in their
    block's bucket. Readers of ``top`` whose branch does not qualify (a router computed whole
    beside the experts and a shared expert that enter tp) keep reading ``top`` as it is; the
    others read it entered. Two hoists pay:

    - several entered values meet in one (a split's pieces, per-step selects, per-expert slices
      of dense routing weights) that is no larger than they are together: one all-reduce instead
      of one each. A split is entered on its input's edge (after the reduction that made the
      input whole), since its pieces are a tuple: Mamba's step size, B and C cost one all-reduce.
    - a chain computed from one parameter alone (``1 + w.float()``, ``softplus(alpha)``): entered
      at the parameter, which then joins its block's bucket (:meth:`LayoutPlan.enter_tp_buckets`).
    """
    _EnterHoist(edges, layouts, carries_grad).run()


class _EnterHoist:
    """One pass of :func:`hoist_enter_tp` over a plan's edges (changed in place)."""

    def __init__(self, edges: dict, layouts: dict, carries_grad: frozenset[fx.Node]):
        self.edges, self.layouts, self.carries_grad = edges, layouts, carries_grad

    def gradient_inputs(self, node: fx.Node) -> list[fx.Node]:
        if node.target in VIEWS or node.target in SHAPED_LIKE:
            return [node.args[0]] if isinstance(node.args[0], fx.Node) else []
        return [i for i in node.all_input_nodes if i in self.carries_grad]

    def below(self, top: fx.Node):
        """The values between ``top`` and its ``enter_tp`` edges, those edges, the weights to
        enter with them and the readers of ``top`` to enter it for, when ``top`` may be entered in
        their place. A reader of ``top`` whose branch reaches replicated work (a router beside
        a shared expert and the routed experts) keeps reading ``top`` itself."""
        readers = tuple(top.users)
        found = self.reach(top, readers)
        if found is None:
            readers = tuple(user for user in top.users if self.reach(top, (user,)) is not None)
            found = self.reach(top, readers) if readers else None
        return None if found is None else (*found, readers)

    def reach(self, top: fx.Node, readers: tuple[fx.Node, ...]):
        members: set[fx.Node] = set()
        pairs, frontier = [], [top]
        while frontier:
            node = frontier.pop()
            if not node.users:
                return None
            for user in (readers if node is top else node.users):
                steps = self.edges.get((node, user))
                if steps == ENTER_ONLY:
                    pairs.append((node, user))
                elif steps is not None or user.op != "call_function" or is_sharded(self.layouts.get(user)):
                    return None
                elif getattr(getattr(user.target, "_schema", None), "is_mutable", False):
                    return None
                elif user not in members:
                    if len(members) == _HOIST_REACH:
                        return None
                    members.add(user)
                    frontier.append(user)
        weights = []
        for member in sorted(members, key=lambda n: n.name):  # every rank plans alike: no set order
            for i in self.gradient_inputs(member):
                if (i is top and member in readers) or i in members:
                    continue
                weight, reader = self.parameter_read(i, member)
                if weight is None:
                    return None  # a gradient from elsewhere meets top's below it
                weights.append((weight, reader))  # a weight of replicated work (LoRA's lora_A): entered too
        return members, pairs, weights

    def parameter_read(self, value: fx.Node, member: fx.Node):
        """(the parameter, the op reading it) when ``value`` is a parameter, or a view of one read
        by ``member`` alone (litgpt's ``x @ self.lora_A.transpose(0, 1)``), with nothing entered on
        the way; else (None, None)."""
        reader = member
        while value.op == "call_function" and value.target in VIEWS and len(value.users) == 1 \
                and isinstance(value.args[0], fx.Node) and (value, reader) not in self.edges:
            value, reader = value.args[0], value
        if value.op != "get_attr" or (value, reader) in self.edges:
            return None, None
        return value, reader

    def ancestors(self, node: fx.Node):
        """Replicated values ``node``'s gradient flows to, nearest first."""
        seen, frontier = {node}, [node]
        for _ in range(_HOIST_DEPTH):
            frontier = [i for n in frontier for i in self.gradient_inputs(n) if i not in seen
                        and i in self.carries_grad and not is_sharded(self.layouts.get(i))]
            seen.update(frontier)
            yield from dict.fromkeys(frontier)

    def gains(self, top: fx.Node, found, current) -> bool:
        """Whether entering ``top`` for only some of its readers serves more entered uses than
        the climb holds so far (else the climb would only move tp's entry past a norm's weight)."""
        return found[3] == tuple(top.users) or len(found[1]) > (len(current[1]) if current else 1)

    def climb(self, value: fx.Node):
        """The highest ``top`` above ``value`` that may be entered for it, what lies below it, and
        the split the climb last passed, if it stopped there (then entered on its input's edge)."""
        top, split, node, found = value, None, value, None
        while True:
            step = next(((a, r) for a in self.ancestors(node)
                         if (r := self.below(a)) is not None and node in r[0] and self.gains(a, r, found)), None)
            if step is None:
                return top, split, found
            node, found = step
            if isinstance(node.meta.get("val"), (tuple, list)):
                split = node
            else:
                top, split = node, None

    def run(self) -> None:
        entered = sorted({v for (v, c), steps in self.edges.items() if steps == ENTER_ONLY}, key=lambda n: n.name)
        for value in entered:
            if not any(self.edges.get((value, user)) == ENTER_ONLY for user in value.users):
                continue  # already entered higher up
            top, split, found = self.climb(value)
            if found is None:
                continue
            if split is not None:
                found = self.below(split)
            _, pairs, weights, readers = found
            values = {v for v, _ in pairs}
            whole = split.args[0] if split is not None else top
            at_parameter = split is None and top.op == "get_attr"
            sizes = [_numel(v) for v in (whole, *values)]
            if not at_parameter and (len(values) < 2 or (None not in sizes and sizes[0] > sum(sizes[1:]))):
                continue
            for pair in pairs:
                del self.edges[pair]
            for pair in weights:
                self.edges[pair] = ENTER_ONLY
            if split is not None:
                self.edges[(whole, split)] = self.edges.get((whole, split), ()) + ENTER_ONLY
            else:
                for user in readers:
                    self.edges[(top, user)] = ENTER_ONLY


# how far (values below, ancestors above) one ``enter_tp`` may be hoisted
_HOIST_REACH, _HOIST_DEPTH = 256, 8


def _numel(node: fx.Node) -> int | None:
    """Elements of ``node``'s value; None when not a known number (tokens per expert), and a hoist
    is then judged by count alone."""
    val = node.meta.get("val")
    try:
        return int(val.numel()) if isinstance(val, torch.Tensor) else None
    except (TypeError, ValueError, RuntimeError):
        return None
