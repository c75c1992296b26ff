"""Cut the sequence over the ``cp`` axis: rewrite a captured graph into one cp rank's graph.

Inputs arrive whole (every rank of a cp group is given the same batch). A value holding the data's
sequence is *cut* where it first meets a parameter (the token ids an embedding reads, the hidden
states a linear reads): its sequence dim (dim 1, ``[batch, seq, ...]``) keeps this rank's positions
only (:func:`autoshard.runtime.context_ops.local_positions`, two chunks load-balanced for causal attention).
From there the cut follows each op's layout rule, as tp layouts do:

* ops that work position by position (pointwise ops, views, norms, linears, embeddings, reductions
  over other dims) keep the cut; a whole value they meet along the cut dim (a rotary table, a mask,
  shifted labels, a position bias) is indexed at this rank's positions, locally: no communication,
  and whatever computed it (``arange(seq)``, position ids, cumulative sums over whole values) keeps
  computing on every position, so every value derived from positions is right without being named;
* ops that combine values by their dims follow the cut dim to the output: ``outer(a, b)`` keeps a's
  cut on dim 0 (b's on dim 1), an ``einsum`` or a matmul keeps the subscript the cut dim holds, a
  broadcast product keeps the cut of the operand whose dim is the sequence, ``repeat`` and ``tile``
  hold it several times over, complex views (``view_as_complex``, ``polar``) keep it, and an op taking
  only the dtype or device of a value (``type_as``, ``new_ones``) does not take its cut. So a rotary
  table built from positions the cut reached first is built from this rank's positions;
* attention (SDPA, or the matmul-softmax-matmul form) reads every rank's keys and values: they are
  all-gathered over cp (``cp_gather``, whose backward reduce-scatters their gradients, the approach
  the Llama 3 paper describes). A causal SDPA (``is_causal``) becomes ``cp_causal_attention``: each
  local chunk reads the keys up to its own end, so every rank reads as many (query, key) pairs and
  none past the diagonal block; an explicit mask (or a bias) is indexed at this rank's query
  positions and every key is read;
* a sum or mean over the cut dim (a loss over tokens) is finished with ``cp_all_reduce``; a
  token-mean loss divides the all-reduced sum by the all-reduced count, so ignored labels count as
  on one device;
* an op that mixes positions along the cut dim (a cumulative sum, a shift, a convolution over the
  sequence) reads the cut value all-gathered whole, and the plan names it;
* an op with no rule raises ``NotImplementedError`` naming the node and its source line.

Graph outputs still cut are all-gathered whole, so the result returns what the model returns.
The rewritten graph's values get their local shapes by fake-tensor propagation; tp then plans it as
it plans any graph. A view the local layout cannot take (export drops a ``contiguous()`` that was a
no-op on one device, and the cut's attention returns another layout) becomes a reshape there. No error
of torch's leaves the cut unnamed: an op that fails on the local shapes is a ``NotImplementedError``
naming it and its source line, anything else an ``InternalError``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.passes.cp_attention import AttentionRules
from autoshard.passes.cp_errors import reraise
from autoshard.passes.cp_pointwise import PointwiseRules
from autoshard.passes.cp_products import ProductRules
from autoshard.passes.cp_reductions import ReductionRules
from autoshard.passes.cp_views import ViewRules
from autoshard.passes.local_shapes import refresh_shapes
from autoshard.passes.position_tables import PositionTables
from autoshard.passes.sequence_ops import (
    ALONG_DIM,
    ELEMENTWISE,
    LIKE_FIRST,
    NEW,
    NLL,
    REDUCTIONS,
    SAME_SHAPE,
    SCATTERS,
    SDPA,
    SUMS,
    VIEWS,
    Cut,
    Gather,
    op_name,
    shape_of,
    val_of,
)
from autoshard.plans.context_plan import ContextPlan
from autoshard.runtime.context_ops import CP_GATHER, CP_LOCAL_OUTPUT, CP_POSITIONS

aten = torch.ops.aten

SEQ_DIM = 1  # inputs and activations are [batch, seq, ...]


def cut_sequence(gm: fx.GraphModule, seq: int, cp: int, group_name: str, params: set[str],
                 balanced: bool = True, local_outputs: bool = False) -> ContextPlan:
    """Rewrite ``gm`` (captured for whole sequences of ``seq``) into one cp rank's code, in place.

    ``balanced=False`` cuts the sequence in ``cp`` contiguous pieces instead, and causal attention
    reads every key: the layout load balancing is measured against (``benchmarks/bench_cp.py``).
    ``local_outputs`` returns outputs cut along their sequence dim as they are (``cp_local_output``)
    instead of gathering them."""
    if seq % (2 * cp):
        raise ValueError(f"autoshard: context parallelism cuts the sequence in 2*cp = {2 * cp} chunks, and the "
                         f"sequence length {seq} (dim {SEQ_DIM} of the first input) does not divide by {2 * cp}")
    rewriter = _Rewriter(gm, seq, cp, group_name, params, balanced, local_outputs)
    try:
        rewriter.run()
        gm.graph.lint()
    except Exception as err:
        reraise(err, rewriter.visiting)
    gm.recompile()
    refresh_shapes(gm, rewriter.inserted)
    return ContextPlan(seq, cp, tuple(rewriter.gathered_whole), tuple(rewriter.attention), tuple(rewriter.entries),
                       rewriter.output_cuts)


class _Rewriter(PositionTables, PointwiseRules, ViewRules, ProductRules, ReductionRules, AttentionRules):
    """The walk of one cut: its state, the building blocks every rule inserts with, and the rule
    each op follows (the rules themselves are the methods of its bases, one kind of op each)."""

    def __init__(self, gm: fx.GraphModule, seq: int, cp: int, group_name: str, params: set[str], balanced: bool,
                 local_outputs: bool):
        self.graph = gm.graph
        self.seq, self.cp, self.group = seq, cp, group_name
        self.local = seq // cp
        self.params = params
        self.cut: dict[fx.Node, Cut | tuple | None] = {}
        self.data: set[fx.Node] = set()  # values computed from the inputs
        self.indices: dict[tuple[int, int], fx.Node] = {}
        self.gathers: dict[fx.Node, fx.Node] = {}
        self.positions: fx.Node | None = None
        self.gathered_whole: list[tuple[str, str]] = []
        self.attention: list[str] = []
        self.entries: list[str] = []
        self.dead: list[fx.Node] = []  # nodes replaced, erased once the walk is done
        self.masks: dict[tuple[int, int, int], fx.Node] = {}
        self.balanced = balanced
        self.local_outputs = local_outputs
        self.kept_cut: dict[fx.Node, int] = {}
        self.inserted: set[fx.Node] = set()  # nodes the cut added (a failure there is autoshard's)
        self.visiting: fx.Node | None = None  # the node whose rule runs (named by an internal error)
        self.output_cuts: tuple[int | None, ...] = ()

    # --- driving -------------------------------------------------------------------------------

    def run(self) -> None:
        nodes = list(self.graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        like = next((n for n in placeholders if isinstance(val_of(n), torch.Tensor)), None)
        if like is None:
            raise ValueError("autoshard: context parallelism needs a tensor input holding the sequence")
        self.data.update(placeholders)
        with self.graph.inserting_after(placeholders[-1]):
            self.positions = self.graph.call_function(CP_POSITIONS, (like, self.seq, self.cp, self.group,
                                                                     self.balanced))
        self.inserted.add(self.positions)
        for node in nodes:
            self.visiting = node
            if node.op == "call_function":
                if any(a in self.data for a in node.all_input_nodes):
                    self.data.add(node)
                self._visit(node)
            elif node.op == "output":
                self._output(node)
        self.visiting = None
        for node in reversed(self.dead):
            for user in list(node.users):
                if user.target is operator.getitem and not user.users:
                    self.graph.erase_node(user)
            if not node.users:
                self.graph.erase_node(node)

    def _visit(self, node: fx.Node) -> None:
        if not any(self._cut_of(a) for a in node.all_input_nodes):
            self._maybe_enter(node)
        if not any(self._cut_of(a) for a in node.all_input_nodes):
            self.cut[node] = None
            return
        try:
            self.cut[node] = self._rule(node)
        except Gather as why:
            for value in node.all_input_nodes:
                if self._cut_of(value):
                    node.replace_input_with(value, self._gather(value, node))
            self.gathered_whole.append((node.name, str(why)))
            self.cut[node] = None

    def _cut_of(self, value) -> Cut | tuple | None:
        return self.cut.get(value) if isinstance(value, fx.Node) else None

    def _maybe_enter(self, node: fx.Node) -> None:
        """Cut, on arrival at ``node``, a whole data value holding the sequence that meets a parameter."""
        reads_param = any(a.op == "get_attr" and a.target in self.params for a in node.all_input_nodes)
        if not reads_param:
            return
        for value in node.all_input_nodes:
            shape = shape_of(value)
            if value in self.data and shape is not None and len(shape) > SEQ_DIM and shape[SEQ_DIM] == self.seq:
                node.replace_input_with(value, self._index(value, Cut(SEQ_DIM), node))
                self.entries.append(value.name)

    def _output(self, node: fx.Node) -> None:
        def whole(arg):
            cut = self._cut_of(arg) if isinstance(arg, fx.Node) else None
            if isinstance(cut, Cut) and self.local_outputs and cut == Cut(cut.dim):
                kept = self._insert(node, CP_LOCAL_OUTPUT, (arg, self.cp), like=arg, owner=arg)
                self.kept_cut[kept] = cut.dim
                return kept
            if isinstance(cut, Cut):
                return self._gather(arg, node)
            if isinstance(arg, fx.Node) and isinstance(self._cut_of(arg), tuple):
                raise NotImplementedError(f"autoshard: {describe(arg)} is a graph output holding cut values")
            return arg

        node.args = fx.node.map_aggregate(node.args, whole)
        self.output_cuts = tuple(self.kept_cut.get(leaf) if isinstance(leaf, fx.Node) else None
                                 for leaf in _leaves(node.args[0]))

    # --- building blocks -------------------------------------------------------------------------

    def _insert(self, before: fx.Node, target, args, kwargs=None, like: fx.Node | None = None,
                owner: fx.Node | None = None) -> fx.Node:
        """A new node before ``before``, in the block of ``owner`` (default ``before``); ``like``: the
        node whose whole (pre-cut) value it stands for (every rule reads whole shapes: they are made
        local only once the walk is done)."""
        with self.graph.inserting_before(before):
            new = self.graph.call_function(target, tuple(args), kwargs or {})
        self.inserted.add(new)
        owner = owner if owner is not None else before
        for key in ("stack_trace", "nn_module_stack"):
            if key in owner.meta:
                new.meta[key] = owner.meta[key]
        if like is not None and "val" in like.meta:
            new.meta["val"] = like.meta["val"]
        return new

    def _index(self, value: fx.Node, cut: Cut, consumer: fx.Node) -> fx.Node:
        """``value`` (whole) cut as ``cut`` at ``consumer``."""
        index = self._index_for(cut.before, cut.after)
        new = self._insert(consumer, aten.index_select.default, (value, cut.dim, index), like=value)
        self.cut[new] = cut
        return new

    def _gather(self, value: fx.Node, consumer: fx.Node) -> fx.Node:
        """``value`` (cut) whole again: all-gathered over cp in sequence order (cached)."""
        if value in self.gathers:
            return self.gathers[value]
        cut = self._cut_of(value)
        assert isinstance(cut, Cut)
        shape = shape_of(value)
        anchor = value.next
        if cut.before == 1 and cut.after == 1:
            new = self._insert(anchor, CP_GATHER, (value, cut.dim, self.cp, self.group), like=value, owner=value)
        else:
            split = [*shape[:cut.dim], cut.before, self.local, cut.after, *shape[cut.dim + 1:]]
            view = self._insert(anchor, aten.reshape.default, (value, split), owner=value)
            gathered = self._insert(anchor, CP_GATHER, (view, cut.dim + 1, self.cp, self.group), owner=value)
            whole = list(shape)
            whole[cut.dim] = cut.before * self.seq * cut.after
            new = self._insert(anchor, aten.reshape.default, (gathered, whole), like=value, owner=value)
        self.cut[new] = None
        self.gathers[value] = new
        return new

    def _global(self, cut: Cut) -> int:
        return cut.before * self.seq * cut.after

    # --- rules -------------------------------------------------------------------------------------

    def _rule(self, node: fx.Node):
        target = node.target
        if target is operator.getitem:
            parent = self._cut_of(node.args[0])
            return parent[node.args[1]] if isinstance(parent, tuple) else parent
        if target is SDPA:
            return self._sdpa(node)
        if target in VIEWS:
            return self._view(node)
        if target in (aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                      aten.transpose.int, aten.t.default, aten.permute.default, aten.expand.default,
                      aten.select.int, aten.slice.Tensor, aten.narrow.default, aten.unflatten.int,
                      aten.flatten.using_ints):
            return self._dim_map(node)
        if target in SUMS or target in REDUCTIONS:
            return self._reduce(node)
        if target in ALONG_DIM:
            return self._along(node)
        if target in (aten.linear.default, aten.mm.default, aten.matmul.default, aten.bmm.default,
                      aten.addmm.default):
            return self._matmul(node)
        if target in (aten.outer.default, aten.ger.default, aten.einsum.default):
            return self._einsum(node)
        if target in (aten.view_as_real.default, aten.view_as_complex.default):
            return self._complex_view(node)
        if target in (aten.repeat.default, aten.tile.default):
            return self._repeat(node)
        if target is aten.expand_as.default:
            return self._expand_as(node)
        if target in LIKE_FIRST:
            return self._cut_of(node.args[0])
        if target in NEW:
            return None
        if target is aten.embedding.default:
            return self._embedding(node)
        if target in (aten.native_layer_norm.default, aten.layer_norm.default, aten.rms_norm.default,
                      aten._fused_rms_norm.default):
            return self._norm(node)
        if target in (aten.cat.default, aten.stack.default):
            return self._cat(node)
        if target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
                      aten.split.sizes):
            return self._split(node)
        if target is aten.native_dropout.default:
            cut = self._pointwise(node, node.args[:1])
            return (cut, cut)
        if target in NLL:
            return self._nll(node)
        if target is aten.cross_entropy_loss.default:
            return self._cross_entropy(node)
        if target is aten.index_select.default and self._cut_of(node.args[0]) and not self._cut_of(node.args[2]):
            cut = self._cut_of(node.args[0])
            if cut.dim == int(node.args[1]) % len(shape_of(node.args[0])):
                raise Gather("index_select along the sequence")
            return cut
        if target in SAME_SHAPE or target in ELEMENTWISE or (isinstance(target, torch._ops.OpOverload)
                                                              and torch.Tag.pointwise in target.tags):
            return self._pointwise(node, node.all_input_nodes)
        if target is aten.index.Tensor:
            return self._pick(node)
        if target in SCATTERS:
            return self._scatter(node)
        if target in (aten.topk.default, aten.sort.default, aten.argsort.default, aten.sort.stable,
                      aten.argsort.stable):
            return self._along_other_dim(node)
        if target is aten.repeat_interleave.self_int:
            return self._repeat_interleave(node)
        if target in (aten.pad.default, aten.constant_pad_nd.default, aten.convolution.default,
                      aten.conv1d.default):
            raise Gather(f"{op_name(target)} may mix positions along the sequence")
        raise NotImplementedError(
            f"autoshard: context parallelism has no rule for {describe(node)}, which reads values cut along the "
            f"sequence")


def _leaves(arg) -> list:
    found = []
    fx.node.map_aggregate(arg, lambda a: found.append(a))
    return found
