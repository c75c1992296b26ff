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

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autoshard.core.errors import InternalError, describe
from autoshard.passes.contractions import einsum_subscripts
from autoshard.plans.context_plan import ContextPlan
from autoshard.runtime.context_ops import CP_ALL_REDUCE, CP_CAUSAL_ATTENTION, CP_GATHER, CP_LOCAL_OUTPUT, CP_POSITIONS

aten = torch.ops.aten

SEQ_DIM = 1  # inputs and activations are [batch, seq, ...]


@dataclasses.dataclass(frozen=True)
class Cut:
    """A dim cut over cp. The dim's whole size is ``before * seq * after`` (a view merged the
    sequence with ``before`` outer and ``after`` inner elements); this rank holds
    ``before * (seq // cp) * after`` of them."""

    dim: int
    before: int = 1
    after: int = 1


class _Gather(Exception):
    """An op that mixes positions along its input's cut dim: its cut inputs are read whole."""


_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SAME_SHAPE = {aten.clone.default, aten.contiguous.default, aten.detach.default, aten.alias.default,
               aten.lift_fresh_copy.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
               aten.to.device, aten.dropout.default,
               aten.feature_dropout.default, aten.alpha_dropout.default, aten.fill.Scalar,
               aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
               aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self, aten.where.ScalarSelf,
               aten.where.ScalarOther, aten.copy.default}
# elementwise, though not tagged pointwise: complex numbers made and taken apart (a complex rotary table)
_ELEMENTWISE = {aten.polar.default, aten.complex.default, aten.real.default, aten.imag.default, aten.conj.default,
                aten._conj.default, aten.resolve_conj.default, aten.resolve_neg.default}
# the first operand's values in the dtype (and device) of the second, which gives nothing else
_LIKE_FIRST = {aten.type_as.default, aten.to.other}
# a new tensor of the size given, in the dtype and device of a value that gives nothing else (``x.new_ones(s)``)
_NEW = {aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
        aten.new_empty_strided.default}
_IN_PLACE_SCATTERS = {aten.scatter_.src, aten.scatter_.value, aten.scatter_add_.default, aten.scatter_reduce_.two}
# ops writing or reading each position's entries along ``dim`` (arg 1), by an index of the input's shape
_SCATTERS = {aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two,
             aten.gather.default, *_IN_PLACE_SCATTERS}
_SUMS = {aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default}
_REDUCTIONS = {aten.amax.default, aten.amin.default, aten.var.correction, aten.std.correction,
               aten.logsumexp.default, aten.any.dim, aten.all.dim, aten.argmax.default, aten.argmin.default,
               aten.norm.ScalarOpt_dim, aten.linalg_vector_norm.default}
_ALONG_DIM = {aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int,
              aten.cumsum.default, aten.cumprod.default, aten.flip.default, aten.roll.default,
              aten.diff.default}
_SDPA = aten.scaled_dot_product_attention.default
_NLL = (aten.nll_loss_forward.default, aten.nll_loss.default, aten.nll_loss_nd.default)


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
        _reraise(err, rewriter.visiting)
    gm.recompile()
    refresh_shapes(gm, rewriter.inserted)
    return ContextPlan(seq, cp, tuple(rewriter.gathered_whole), tuple(rewriter.attention), tuple(rewriter.entries),
                       rewriter.output_cuts)


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
        _reraise(err, None)
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
            return _unexpected(err, n)
        inputs = ", ".join(f"'{a.name}' {list(_val(a).shape)}" for a in n.all_input_nodes
                           if isinstance(_val(a), torch.Tensor))
        return NotImplementedError(f"autoshard: context parallelism cannot run {describe(n)} on this rank's part "
                                   f"of the sequence (local inputs: {inputs or 'none'}): {type(err).__name__}: "
                                   f"{_first_line(err)}")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def _reraise(err: Exception, node: fx.Node | None):
    """Raise ``err`` as :func:`_unexpected` makes it leave the cut (called in an ``except`` block)."""
    wrapped = _unexpected(err, node)
    if wrapped is err:
        raise err
    raise wrapped from err


def _unexpected(err: Exception, node: fx.Node | None) -> Exception:
    """``err`` as it leaves the cut: an autoshard error meant for the user (a ``ValueError`` or
    ``NotImplementedError`` whose message starts ``autoshard``) or an :class:`InternalError` as is, any
    other error an :class:`InternalError` naming ``node`` (a ``ValueError`` of torch's or of Python's
    included, which the stage would otherwise let through as a user's error)."""
    if isinstance(err, InternalError) or (isinstance(err, (ValueError, NotImplementedError))
                                          and str(err).startswith("autoshard")):
        return err
    where = f" at {describe(node)}" if node is not None else ""
    return InternalError(f"autoshard: internal error in stage 'cut the sequence'{where}: {type(err).__name__}: "
                         f"{_first_line(err)}. This is a bug in autoshard: please report it with the model's code")


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _shape(node) -> tuple[int, ...] | None:
    value = _val(node)
    return tuple(int(s) for s in value.shape) if isinstance(value, torch.Tensor) else None


class _Rewriter:
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
        like = next((n for n in placeholders if isinstance(_val(n), torch.Tensor)), None)
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
        except _Gather as why:
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
            shape = _shape(value)
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

    def _index_for(self, before: int, after: int) -> fx.Node:
        """This rank's entries of a dim of ``before * seq * after``, as an index (cached)."""
        key = (before, after)
        if key not in self.indices:
            index = self.positions
            if before > 1 or after > 1:
                index = self._insert(self.positions.next, _merged_index, (self.positions, self.seq, before, after),
                                     owner=self.positions)
            self.indices[key] = index
        return self.indices[key]

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
        shape = _shape(value)
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
        if target is _SDPA:
            return self._sdpa(node)
        if target in _VIEWS:
            return self._view(node)
        if target in (aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                      aten.transpose.int, aten.t.default, aten.permute.default, aten.expand.default,
                      aten.select.int, aten.slice.Tensor, aten.narrow.default, aten.unflatten.int,
                      aten.flatten.using_ints):
            return self._dim_map(node)
        if target in _SUMS or target in _REDUCTIONS:
            return self._reduce(node)
        if target in _ALONG_DIM:
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
        if target in _LIKE_FIRST:
            return self._cut_of(node.args[0])
        if target in _NEW:
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
        if target in _NLL:
            return self._nll(node)
        if target is aten.cross_entropy_loss.default:
            return self._cross_entropy(node)
        if target is aten.index_select.default and self._cut_of(node.args[0]) and not self._cut_of(node.args[2]):
            cut = self._cut_of(node.args[0])
            if cut.dim == int(node.args[1]) % len(_shape(node.args[0])):
                raise _Gather("index_select along the sequence")
            return cut
        if target in _SAME_SHAPE or target in _ELEMENTWISE or (isinstance(target, torch._ops.OpOverload)
                                                                and torch.Tag.pointwise in target.tags):
            return self._pointwise(node, node.all_input_nodes)
        if target is aten.index.Tensor:
            return self._pick(node)
        if target in _SCATTERS:
            return self._scatter(node)
        if target in (aten.topk.default, aten.sort.default, aten.argsort.default, aten.sort.stable,
                      aten.argsort.stable):
            return self._along_other_dim(node)
        if target is aten.repeat_interleave.self_int:
            return self._repeat_interleave(node)
        if target in (aten.pad.default, aten.constant_pad_nd.default, aten.convolution.default,
                      aten.conv1d.default):
            raise _Gather(f"{_op_name(target)} may mix positions along the sequence")
        raise NotImplementedError(
            f"autoshard: context parallelism has no rule for {describe(node)}, which reads values cut along the "
            f"sequence")

    def _pointwise(self, node: fx.Node, values) -> Cut:
        out_ndim = len(_shape(node)) if _shape(node) is not None else 0
        target_cut = None
        values = list(values)
        for i, value in enumerate(values):
            cut = self._cut_of(value)
            if isinstance(cut, Cut):
                aligned = cut.dim + out_ndim - len(_shape(value))
                if aligned < 0:  # not broadcast into the output: no elementwise rule says where the cut goes
                    raise NotImplementedError(f"autoshard: context parallelism cannot follow the cut of "
                                              f"'{value.name}' through {describe(node)}, whose output has fewer "
                                              f"dims than that input")
                if target_cut is None:
                    target_cut = dataclasses.replace(cut, dim=aligned)
                elif dataclasses.replace(cut, dim=aligned) != target_cut:
                    # cut otherwise: read whole, then (below) indexed as the output is cut where it holds it
                    values[i] = self._gather(value, node)
                    node.replace_input_with(value, values[i])
        assert target_cut is not None
        for value in values:
            if self._cut_of(value) is None and isinstance(_val(value), torch.Tensor):
                shape = _shape(value)
                at = target_cut.dim - (out_ndim - len(shape))
                if at >= 0 and shape[at] == self._global(target_cut):
                    node.replace_input_with(value, self._index(value, dataclasses.replace(target_cut, dim=at), node))
                elif at >= 0 and shape[at] != 1:
                    raise NotImplementedError(f"autoshard: {describe(node)} broadcasts '{value.name}' of size "
                                              f"{shape[at]} against a sequence of {self._global(target_cut)}")
        return target_cut

    def _dim_map(self, node: fx.Node) -> Cut:
        """Ops that move, add or drop dims: where the cut dim goes (or a gather if it is sliced)."""
        target, src = node.target, node.args[0]
        cut = self._cut_of(src)
        in_shape, out_shape = _shape(src), _shape(node)
        nd_in, nd_out = len(in_shape), len(out_shape)
        dim = cut.dim
        if target is aten.unsqueeze.default:
            at = node.args[1] % nd_out
            return dataclasses.replace(cut, dim=dim + (at <= dim))
        if target in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            dims = node.args[1] if len(node.args) > 1 else [i for i, s in enumerate(in_shape) if s == 1]
            dims = [d % nd_in for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
            dims = [d for d in dims if in_shape[d] == 1]
            return dataclasses.replace(cut, dim=dim - sum(d < dim for d in dims))
        if target in (aten.transpose.int, aten.t.default):
            a, b = (node.args[1] % nd_in, node.args[2] % nd_in) if target is aten.transpose.int else (0, 1)
            return dataclasses.replace(cut, dim=b if dim == a else a if dim == b else dim)
        if target is aten.permute.default:
            order = [d % nd_in for d in node.args[1]]
            return dataclasses.replace(cut, dim=order.index(dim))
        if target is aten.expand.default:
            new_dim = dim + nd_out - nd_in
            sizes = list(node.args[1])
            if sizes[new_dim] == self._global(cut):
                sizes[new_dim] = -1
                node.args = (src, sizes, *node.args[2:])
            return dataclasses.replace(cut, dim=new_dim)
        if target in (aten.select.int, aten.slice.Tensor, aten.narrow.default):
            at = node.args[1] % nd_in if len(node.args) > 1 else 0
            if at == dim:
                if target is aten.slice.Tensor and _covers(node, self._global(cut)):
                    return cut
                raise _Gather(f"{_op_name(target)} along the sequence")
            return dataclasses.replace(cut, dim=dim - (target is aten.select.int and at < dim))
        if target is aten.unflatten.int:
            at = node.args[1] % nd_in
            if at == dim:
                return self._view(node)
            return dataclasses.replace(cut, dim=dim + (nd_out - nd_in if at < dim else 0))
        if target is aten.flatten.using_ints:
            args = _bound(node)
            start, end = args["start_dim"] % nd_in, args["end_dim"] % nd_in
            if start <= dim <= end:
                return self._view(node)
            return dataclasses.replace(cut, dim=dim - (end - start) if dim > end else dim)
        raise AssertionError(target)

    def _view(self, node: fx.Node) -> Cut:
        """A reshape: the out dim holding the sequence factor, and its shape argument made local."""
        src = node.args[0]
        cut = self._cut_of(src)
        in_shape, out_shape = _shape(src), _shape(node)
        outer = cut.before
        for size in in_shape[:cut.dim]:
            outer *= size
        # the flat offset structure: outer * seq * inner, row-major
        prefix = 1
        for j, size in enumerate(out_shape):
            if outer % prefix == 0 and (prefix * size) % (outer * self.seq) == 0 and prefix <= outer:
                before = outer // prefix
                after = (prefix * size) // (outer * self.seq)
                new = Cut(j, before, after)
                if node.target in _VIEWS:
                    sizes = list(node.args[1])
                    if sizes[j] != -1:
                        sizes[j] = before * self.local * after
                    node.args = (src, sizes, *node.args[2:])
                elif node.target is aten.unflatten.int:
                    sizes = list(node.args[2])
                    k = j - node.args[1] % len(in_shape)
                    if sizes[k] != -1:
                        sizes[k] = before * self.local * after
                    node.args = (src, node.args[1], sizes)
                return new
            prefix *= size
        raise _Gather("a view that splits the sequence dim")

    def _reduce(self, node: fx.Node):
        src = node.args[0]
        cut = self._cut_of(src)
        nd_in = len(_shape(src))
        if node.target in (aten.sum.default, aten.mean.default):
            dims, keep = list(range(nd_in)), False
        else:  # by name: ``linalg_vector_norm(x, ord, dim, keepdim)``'s second argument is no dim
            args = _bound(node)
            raw = args.get("dim")
            dims = list(range(nd_in)) if raw is None or raw == [] else [
                d % nd_in for d in (raw if isinstance(raw, (list, tuple)) else [raw])]
            keep = bool(args.get("keepdim", False))
        if cut.dim not in dims:
            return dataclasses.replace(cut, dim=cut.dim if keep else cut.dim - sum(d < cut.dim for d in dims))
        if node.target not in _SUMS:
            raise _Gather(f"{_op_name(node.target)} over the sequence")
        # a sum over the cut dim: finished over cp; a mean is a sum over the whole count
        users = list(node.users)
        anchor = node.next
        total = node
        if node.target in (aten.mean.dim, aten.mean.default):
            total = self._insert(anchor, aten.mul.Tensor, (node, 1.0 / self.cp), owner=node)
        reduced = self._insert(anchor, CP_ALL_REDUCE, (total, self.cp, self.group), owner=node)
        for user in users:
            user.replace_input_with(node, reduced)
        self.cut[total] = None
        self.cut[reduced] = None
        return None

    def _along(self, node: fx.Node):
        src = node.args[0]
        cut = self._cut_of(src)
        nd = len(_shape(src))
        args = _bound(node)  # roll(x, shifts, dims), diff(x, n, dim): the dims by name, defaults included
        dim = args.get("dim", args.get("dims"))
        dims = list(range(nd)) if dim is None or dim == [] else [d % nd for d in (dim if isinstance(dim, (list, tuple))
                                                                                   else [dim])]
        if cut.dim in dims:
            raise _Gather(f"{_op_name(node.target)} along the sequence")
        return cut

    def _along_other_dim(self, node: fx.Node):
        """``topk`` / ``sort`` along a dim other than the cut one (an MoE router's experts): every
        output keeps the cut."""
        src = node.args[0]
        cut = self._cut_of(src)
        nd = len(_shape(src))
        names = {aten.topk.default: ("self", "k", "dim"), aten.sort.default: ("self", "dim"),
                 aten.argsort.default: ("self", "dim"), aten.sort.stable: ("self",),
                 aten.argsort.stable: ("self",)}[node.target]
        args = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
        if int(args.get("dim", -1)) % nd == cut.dim:
            raise _Gather(f"{_op_name(node.target)} along the sequence")
        return cut if node.target in (aten.argsort.default, aten.argsort.stable) else (cut, cut)

    def _repeat_interleave(self, node: fx.Node) -> Cut:
        """Each row repeated ``repeats`` times (an MoE's tokens, once per chosen expert): along the cut
        dim, each position's rows stay together."""
        src, repeats = node.args[0], node.args[1]
        cut = self._cut_of(src)
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if dim is None:
            raise _Gather("repeat_interleave of a flattened value")
        dim %= len(_shape(src))
        if dim != cut.dim:
            return cut
        return dataclasses.replace(cut, after=cut.after * int(repeats))

    def _matmul(self, node: fx.Node):
        target = node.target
        if target is aten.addmm.default:
            a, b = node.args[1], node.args[2]
        else:
            a, b = node.args[0], node.args[1]
        if target in (aten.matmul.default, aten.mm.default, aten.bmm.default) and min(
                len(_shape(a)), len(_shape(b))) >= 2:
            # [..., m, k] @ [..., k, n]: a cut on m or n (a table built as ``inv_freq @ positions``), or on a
            # batch dim, keeps it; keys cut on k (or a second operand cut otherwise) are read whole
            nd_a, nd_b, nd_out = len(_shape(a)), len(_shape(b)), len(_shape(node))
            batch = [f"...{i}" for i in range(nd_out - 2)]
            subs = [batch[nd_out - nd_a:] + ["m", "k"], batch[nd_out - nd_b:] + ["k", "n"]]
            cut, (a, b) = self._by_subscripts(node, [a, b], subs, batch + ["m", "n"])
            node.args = (a, b, *node.args[2:])
            return cut
        if target is aten.linear.default or self._cut_of(b) is None:
            cut = self._cut_of(a)
            nd_a = len(_shape(a))
            if cut is None or cut.dim == nd_a - 1:
                raise _Gather("a matmul contracting the sequence")
            out_nd = len(_shape(node))
            return dataclasses.replace(cut, dim=cut.dim + out_nd - nd_a)
        # the right operand (keys, values) holds the sequence: read it whole
        node.replace_input_with(b, self._gather(b, node))
        if self._cut_of(a) is None:
            return None
        return self._matmul(node)

    def _einsum(self, node: fx.Node) -> Cut:
        """``einsum`` (and ``outer(a, b)``, which is ``einsum("i,j->ij", a, b)``): the cut follows its
        subscript to the output (a rotary table ``outer(positions, inv_freq)`` keeps the cut of the
        positions on dim 0)."""
        if node.target is aten.einsum.default:
            equation, operands = node.args[0], list(node.args[1])
            subs, out = einsum_subscripts(equation, [len(_shape(v)) for v in operands])
            if len(out) != len(_shape(node)) or any(len(sub) != len(_shape(v)) for sub, v in zip(subs, operands,
                                                                                              strict=True)):
                raise NotImplementedError(f"autoshard: {describe(node)}: context parallelism cannot read the "
                                          f"einsum equation '{equation}'")
            cut, operands = self._by_subscripts(node, operands, subs, out)
            node.args = (equation, operands, *node.args[2:])
            return cut
        cut, operands = self._by_subscripts(node, list(node.args[:2]), [["i"], ["j"]], ["i", "j"])
        node.args = tuple(operands)
        return cut

    def _by_subscripts(self, node: fx.Node, operands: list, subs: list[list[str]], out: list[str]):
        """The output cut and the operands to read, for an op whose dims are named by subscripts
        (``einsum``): the first cut operand's cut dim names a subscript, which the output keeps. Another
        operand cut along that subscript alike keeps its cut; one cut otherwise is read whole (keys
        against cut queries); a whole one holding that subscript at the sequence's length is indexed
        at this rank's positions, one holding it at length 1 is broadcast. A subscript summed over (not
        in ``out``) or repeated (a diagonal) mixes positions: the cut operands are read whole."""
        first = next((i for i, v in enumerate(operands) if isinstance(self._cut_of(v), Cut)), None)
        if first is None:
            raise NotImplementedError(f"autoshard: {describe(node)} reads values cut along the sequence that are not "
                                      f"one tensor")
        cut = self._cut_of(operands[first])
        letter = subs[first][cut.dim]
        name = _op_name(node.target)
        if letter not in out:
            raise _Gather(f"{name} contracting the sequence")
        if any(sub.count(letter) > 1 for sub in subs) or out.count(letter) > 1:
            raise _Gather(f"{name} taking a diagonal along the sequence")
        whole = self._global(cut)
        kept = []  # what each operand becomes: itself, "gather", or the dim to index it along
        for value, sub in zip(operands, subs, strict=True):
            vcut = self._cut_of(value)
            if vcut is not None and not isinstance(vcut, Cut):
                raise NotImplementedError(f"autoshard: {describe(node)} reads '{value.name}', which holds cut values")
            if isinstance(vcut, Cut) and sub[vcut.dim] == letter and vcut == dataclasses.replace(cut, dim=vcut.dim):
                kept.append(None)
                continue
            shape = _shape(value) if isinstance(_val(value), torch.Tensor) else None
            at = sub.index(letter) if shape is not None and letter in sub else None
            size = None if at is None else shape[at]  # whole shapes: a cut operand's too
            if size not in (None, 1, whole):
                raise NotImplementedError(f"autoshard: {describe(node)} reads '{value.name}' of size {size} along "
                                          f"the subscript of a sequence of {whole}")
            kept.append(("gather" if isinstance(vcut, Cut) else None, at if size == whole else None))
        new = []
        for value, how in zip(operands, kept, strict=True):
            if how is not None:
                gather, at = how
                if gather:
                    value = self._gather(value, node)
                if at is not None:
                    value = self._index(value, dataclasses.replace(cut, dim=at), node)
            new.append(value)
        return dataclasses.replace(cut, dim=out.index(letter)), new

    def _complex_view(self, node: fx.Node) -> Cut:
        """``view_as_complex`` (pairs of the last dim made complex) and ``view_as_real`` (a last dim of
        2 added): every other dim, the cut one included, is kept."""
        cut = self._cut_of(node.args[0])
        if node.target is aten.view_as_complex.default and cut.dim == len(_shape(node.args[0])) - 1:
            raise _Gather("view_as_complex of pairs along the sequence")
        return cut

    def _expand_as(self, node: fx.Node) -> Cut:
        """``x.expand_as(other)``: the output has ``other``'s shape, so ``other``'s cut; where ``x``
        broadcasts on that dim (size 1, or no such dim: a norm kept with ``keepdim``) it is taken as it
        is, a whole ``x`` holding the sequence there is indexed at this rank's positions, and one cut
        otherwise is read whole first. With only ``x`` cut, ``other`` (whose shape alone is read)
        holds the sequence where ``x`` does, and is indexed at this rank's positions."""
        x, other = node.args[:2]
        xcut, ocut = self._cut_of(x), self._cut_of(other)
        nd_x, nd_out = len(_shape(x)), len(_shape(other))
        if not isinstance(ocut, Cut):
            if not isinstance(xcut, Cut):
                raise NotImplementedError(f"autoshard: {describe(node)} reads '{x.name}', which holds cut values")
            out = dataclasses.replace(xcut, dim=xcut.dim + nd_out - nd_x)
            if ocut is not None or _shape(other)[out.dim] != self._global(out):
                raise NotImplementedError(f"autoshard: {describe(node)} expands '{x.name}' cut along the sequence "
                                          f"to the shape of '{other.name}', {list(_shape(other))}")
            node.replace_input_with(other, self._index(other, out, node))
            return out
        at = ocut.dim - (nd_out - nd_x)  # x's dim broadcast to other's cut one
        if xcut == dataclasses.replace(ocut, dim=at):
            return ocut
        if xcut is not None:
            if not isinstance(xcut, Cut):
                raise NotImplementedError(f"autoshard: {describe(node)} reads '{x.name}', which holds cut values")
            whole = self._gather(x, node)
            node.replace_input_with(x, whole)
            x = whole
        size = _shape(x)[at] if at >= 0 else 1
        if size == self._global(ocut):
            node.replace_input_with(x, self._index(x, dataclasses.replace(ocut, dim=at), node))
        elif size != 1:
            raise NotImplementedError(f"autoshard: {describe(node)} expands '{x.name}' of size {size} to a sequence "
                                      f"of {self._global(ocut)}")
        return ocut

    def _repeat(self, node: fx.Node) -> Cut:
        """``repeat`` / ``tile``: new dims added in front; the cut dim repeated ``r`` times holds the
        sequence ``r * before`` times over (each copy this rank's positions)."""
        src = node.args[0]
        cut = self._cut_of(src)
        nd_in, nd_out = len(_shape(src)), len(_shape(node))
        repeats = [int(r) for r in node.args[1]]
        repeats = [1] * (nd_out - len(repeats)) + repeats
        dim = cut.dim + nd_out - nd_in
        return dataclasses.replace(cut, dim=dim, before=cut.before * repeats[dim])

    def _embedding(self, node: fx.Node) -> Cut:
        ids = node.args[1]
        cut = self._cut_of(ids)
        if cut is None:
            raise _Gather("an embedding table cut along the sequence")
        return cut

    def _pick(self, node: fx.Node) -> Cut:
        """``table[index]``: a whole table picked by a cut index along its first dim (an expert's
        weights per row, ``W[ids]``) is cut as the index is, its dims leading the result, as an
        embedding is; a cut table, or a pick along another dim, may mix positions."""
        table, indices = node.args[0], node.args[1]
        first = indices[0] if indices else None
        cut = self._cut_of(first) if isinstance(first, fx.Node) else None
        if self._cut_of(table) is None and isinstance(cut, Cut) and len(indices) == 1:
            return cut
        raise _Gather(f"{_op_name(node.target)} may mix positions along the sequence")

    def _scatter(self, node: fx.Node) -> Cut:
        """``scatter``/``gather`` along ``dim`` (a router's mask made by ``zeros_like(scores).scatter_(1,
        top, 1)``): along another dim than the cut one, with every tensor operand cut alike, each
        position's entries stay its own. An in-place one whose buffer is not cut alike cannot be
        read whole instead (its writes would go to a copy): refused by line."""
        tensors = [a for a in node.args if isinstance(a, fx.Node) and isinstance(_val(a), torch.Tensor)]
        cuts = [self._cut_of(a) for a in tensors]
        dim = int(node.args[1]) % len(_shape(node.args[0]))
        if all(isinstance(c, Cut) for c in cuts) and len(set(cuts)) == 1 and cuts[0].dim != dim:
            return cuts[0]
        why = f"{_op_name(node.target)} along the sequence, or of values cut otherwise"
        if node.target in _IN_PLACE_SCATTERS:
            raise NotImplementedError(f"autoshard: context parallelism cannot cut {describe(node)}: {why}, writes "
                                      "into its buffer in place")
        raise _Gather(why)

    def _norm(self, node: fx.Node):
        src = node.args[0]
        cut = self._cut_of(src)
        nd = len(_shape(src))
        normalized = len(node.args[1])
        if cut is None or cut.dim >= nd - normalized:
            raise _Gather("a norm over the sequence")
        if node.target in (aten.native_layer_norm.default, aten._fused_rms_norm.default):
            return (cut, cut, cut)
        return cut

    def _cat(self, node: fx.Node):
        values = list(node.args[0])
        shapes = [_shape(v) for v in values]
        out_nd = len(_shape(node))
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out_nd
        first = next(self._cut_of(v) for v in values if self._cut_of(v))
        stacked = node.target is aten.stack.default
        if not stacked and first.dim == dim:
            raise _Gather("a concatenation along the sequence")
        new_values = []
        for value, shape in zip(values, shapes, strict=True):  # every input cut as the first cut one
            cut = self._cut_of(value)
            if cut == first:
                new_values.append(value)
            elif cut is None and shape[first.dim] == self._global(first):
                new_values.append(self._index(value, first, node))
            else:
                raise _Gather("a concatenation of values cut differently")
        node.args = (new_values, *node.args[1:])
        return dataclasses.replace(first, dim=first.dim + (1 if stacked and dim <= first.dim else 0))

    def _split(self, node: fx.Node):
        src = node.args[0]
        cut = self._cut_of(src)
        nd = len(_shape(src))
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if node.target is aten.unbind.int:
            dim = node.args[1] if len(node.args) > 1 else 0
        dim %= nd
        if dim == cut.dim:
            raise _Gather(f"{_op_name(node.target)} along the sequence")
        pieces = len(_val(node))
        out = dataclasses.replace(cut, dim=cut.dim - (node.target is aten.unbind.int and dim < cut.dim))
        return tuple(out for _ in range(pieces))

    def _sdpa(self, node: fx.Node):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        args = dict(zip(names[:len(node.args)], node.args, strict=True))
        args.update(node.kwargs)
        q, k, v = args["query"], args["key"], args["value"]
        mask = args.get("attn_mask")
        qcut = self._cut_of(q)
        nd = len(_shape(q))
        if not isinstance(qcut, Cut) or qcut.dim != nd - 2 or qcut.before != 1 or qcut.after != 1:
            raise NotImplementedError(f"autoshard: {describe(node)}: context parallelism needs the queries cut along "
                                      f"their sequence dim (-2)")
        if isinstance(mask, fx.Node):
            mask = self._mask_rows(mask, node)
        self.attention.append(node.name)
        rest = {n: args[n] for n in ("dropout_p", "scale", "enable_gqa") if n in args}
        causal = bool(args.get("is_causal", False))
        if causal and mask is not None:
            raise NotImplementedError(f"autoshard: {describe(node)} has both a mask and is_causal")
        if causal and self.balanced and all(self._cut_of(x) == qcut for x in (k, v)):
            return self._causal(node, q, k, v, rest)
        keys, values = [self._gather(x, node) if self._cut_of(x) else x for x in (k, v)]
        if not causal:
            node.args, node.kwargs = (q, keys, values), {**rest, "attn_mask": mask}
            return qcut
        if _shape(keys)[-2] != self.seq:
            raise NotImplementedError(f"autoshard: {describe(node)} is causal over {_shape(keys)[-2]} keys, not the "
                                      f"sequence of {self.seq}")
        # a contiguous cut (for comparison): every query against every key, under a mask of positions
        out = self._insert(node.next, _SDPA, (q, keys, values),
                           {**rest, "attn_mask": self._causal_mask(0, self.local, self.seq)}, like=node, owner=node)
        self.cut[out] = qcut
        self.dead.append(node)
        node.replace_all_uses_with(out)
        return qcut

    def _causal_mask(self, start: int, end: int, keys: int) -> fx.Node:
        """Whether local queries ``start:end`` see each of the first ``keys`` keys; made once, next
        to the positions, and read by every layer."""
        key = (start, end, keys)
        if key not in self.masks:
            anchor = self.positions.next
            rows = self._insert(anchor, aten.slice.Tensor, (self.positions, 0, start, end), owner=self.positions)
            self.masks[key] = self._insert(anchor, _causal_mask, (rows, keys), owner=self.positions)
        return self.masks[key]

    def _mask_rows(self, mask: fx.Node, node: fx.Node) -> fx.Node:
        """An attention mask read at this rank's query positions, every key whole."""
        cut, shape = self._cut_of(mask), _shape(mask)
        rows = len(shape) - 2
        if isinstance(cut, Cut) and cut.dim != rows:
            mask = self._gather(mask, node)
            cut = None
        if cut is None and shape[rows] == self.seq:
            return self._index(mask, Cut(rows), node)
        return mask

    def _causal(self, node: fx.Node, q, k, v, rest) -> Cut:
        """Causal attention of this rank's two chunks over every rank's keys and values, each chunk
        reading the keys up to its own end (``cp_causal_attention``, which gathers k and v)."""
        if rest.get("dropout_p", 0.0):
            raise NotImplementedError(f"autoshard: {describe(node)}: causal attention with dropout under context "
                                      "parallelism (its backward computes the attention again)")
        node.target = CP_CAUSAL_ATTENTION
        node.args, node.kwargs = (q, k, v, self.cp, self.group, rest.get("scale"),
                                  bool(rest.get("enable_gqa", False))), {}
        return self._cut_of(q)

    def _nll(self, node: fx.Node):
        """A loss over tokens: sums over cp; a mean divides by the all-reduced count of tokens that count."""
        logits, target = node.args[0], node.args[1]
        lcut = self._cut_of(logits)
        if not isinstance(lcut, Cut) or lcut.dim != 0:
            raise _Gather("a loss whose rows are not the cut tokens")
        if self._cut_of(target) is None:
            node.replace_input_with(target, self._index(target, lcut, node))
        reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
        if reduction == 0:  # none
            return (lcut, None) if node.target is aten.nll_loss_forward.default else lcut
        if node.target is not aten.nll_loss_forward.default:
            raise NotImplementedError(f"autoshard: {describe(node)}: a reduced loss op other than nll_loss_forward")
        users = list(node.users)
        anchor = node.next
        node.args = (*node.args[:3], 2, *node.args[4:])  # summed here, divided by the whole count below
        loss = self._insert(anchor, operator.getitem, (node, 0), owner=node)
        count = self._insert(anchor, operator.getitem, (node, 1), owner=node)
        loss = self._insert(anchor, CP_ALL_REDUCE, (loss, self.cp, self.group), owner=node)
        count = self._insert(anchor, CP_ALL_REDUCE, (count, self.cp, self.group), owner=node)
        if reduction == 1:
            loss = self._insert(anchor, aten.div.Tensor, (loss, count), owner=node)
        for user in users:
            assert user.target is operator.getitem
            user.replace_all_uses_with(loss if user.args[1] == 0 else count)
            self.dead.append(user)
        for new in list(self.graph.nodes):
            if new in (loss, count):
                self.cut[new] = None
        return (None, None)


    def _loss_rows(self, node: fx.Node) -> Cut:
        """The cut of a loss's rows (its input's, class dim excluded), its target cut to match."""
        logits, target = node.args[0], node.args[1]
        lcut = self._cut_of(logits)
        if not isinstance(lcut, Cut) or lcut.dim == 1 and len(_shape(logits)) > 1:
            raise _Gather("a loss whose class dim is cut")
        tcut = dataclasses.replace(lcut, dim=lcut.dim if lcut.dim == 0 else lcut.dim - 1)
        if self._cut_of(target) is None:
            node.replace_input_with(target, self._index(target, tcut, node))
        elif self._cut_of(target) != tcut:
            raise _Gather("a loss whose targets are cut unlike its inputs")
        return lcut

    def _cross_entropy(self, node: fx.Node):
        """``cross_entropy``: rows summed here, over cp, and a mean divided by the whole count of
        targets that are not ``ignore_index`` (what one device divides by, label smoothing included)."""
        lcut = self._loss_rows(node)
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        args = dict(zip(names[:len(node.args)], node.args, strict=True)) | dict(node.kwargs)
        reduction = args.get("reduction", 1)
        if reduction == 0:
            return dataclasses.replace(lcut, dim=lcut.dim if lcut.dim == 0 else lcut.dim - 1)
        if reduction == 1 and args.get("weight") is not None:
            raise NotImplementedError(f"autoshard: {describe(node)}: a class-weighted mean loss under context "
                                      f"parallelism")
        users = list(node.users)
        anchor = node.next
        node.args, node.kwargs = (args["input"], args["target"]), {
            **{k: v for k, v in args.items() if k not in ("input", "target")}, "reduction": 2}
        total = self._insert(anchor, CP_ALL_REDUCE, (node, self.cp, self.group), owner=node)
        loss = total
        if reduction == 1:
            counted = self._insert(anchor, aten.ne.Scalar, (node.args[1], args.get("ignore_index", -100)), owner=node)
            count = self._insert(anchor, aten.sum.default, (counted,),
                                 {"dtype": _val(node).dtype}, owner=node)
            count = self._insert(anchor, CP_ALL_REDUCE, (count, self.cp, self.group), owner=node)
            loss = self._insert(anchor, aten.div.Tensor, (total, count), owner=node)
        for user in users:
            user.replace_input_with(node, loss)
        for new in (total, loss):
            self.cut[new] = None
        return None


def _leaves(arg) -> list:
    found = []
    fx.node.map_aggregate(arg, lambda a: found.append(a))
    return found


def cp_traffic(gm: fx.GraphModule, layouts: dict, tp: int) -> tuple[tuple[str, int], ...]:
    """``(kind, bytes)`` of each cp collective one training step runs, forward and backward, for
    :func:`autoshard.plans.predict.predicted_comm`: a gather's bytes are those of the whole tensor it
    makes (its tp shard under tp), its backward reduce-scatters as many; an all-reduce's backward is
    one more where a gradient flows."""
    from autoshard.passes.gradient_flow import carries_grad

    carries = carries_grad(gm)
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is CP_CAUSAL_ATTENTION:
            for local in node.args[1:3]:  # k and v: gathered, and in backward gathered again and reduce-scattered
                value = _val(local)
                nbytes = value.numel() * value.element_size() * node.args[3]
                if isinstance(layouts.get(node), int):
                    nbytes //= tp
                out.append(("all_gather", nbytes))
                if local in carries:
                    out += [("all_gather", nbytes), ("reduce_scatter", nbytes)]
            continue
        if node.op != "call_function" or node.target not in (CP_GATHER, CP_ALL_REDUCE):
            continue
        value = _val(node)
        nbytes = value.numel() * value.element_size()
        if isinstance(layouts.get(node), int):
            nbytes //= tp
        forward, backward = ("all_gather", "reduce_scatter") if node.target is CP_GATHER else ("all_reduce",) * 2
        out.append((forward, nbytes))
        if node.args[0] in carries:
            out.append((backward, nbytes))
    return tuple(out)


def _covers(node: fx.Node, size: int) -> bool:
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    return (start in (0, None)) and (end is None or end >= size) and step == 1


def _bound(node: fx.Node) -> dict:
    """An ATen node's arguments by their schema names, defaults filled in (``flatten(x, -2)`` has
    ``end_dim=-1``)."""
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _op_name(target) -> str:
    return getattr(target, "__name__", str(target))


@torch.fx.wrap
def _merged_index(positions: torch.Tensor, seq: int, before: int, after: int) -> torch.Tensor:
    """This rank's entries of a dim of ``before * seq * after`` (a view merged the sequence in)."""
    outer = torch.arange(before, device=positions.device).unsqueeze(1) * seq + positions.unsqueeze(0)
    inner = torch.arange(after, device=positions.device)
    return (outer.unsqueeze(-1) * after + inner).flatten()


@torch.fx.wrap
def _causal_mask(positions: torch.Tensor, keys: int) -> torch.Tensor:
    """``[len(positions), keys]``: query at global position ``p`` sees keys ``0..p``."""
    return positions.unsqueeze(1) >= torch.arange(keys, device=positions.device).unsqueeze(0)
