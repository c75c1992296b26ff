"""Expert sites: matmuls whose weight is one expert of a 3-D (or higher) parameter.

Mixture-of-experts layers keep their experts' weights stacked, ``[E, out, in]``
as Hugging Face stores ``gate_up_proj`` and ``down_proj`` (or ``[E, in, out]``),
and read them per token or per expert:

* ``torch.bmm(W[ids], x.unsqueeze(-1))``   -> ``aten.index.Tensor(W, [ids])`` then ``aten.bmm``
* ``torch.bmm(x.view(E, -1, d), W)``       -> ``aten.bmm`` of the whole ``[E, in, out]``: expert ``e`` on batch ``e``
* ``F.linear(x, W[e])`` in a loop          -> ``aten.select.int(W, 0, e)`` then ``aten.linear``
* ``x @ W[e]`` / ``x @ W[e].T``            -> ``select`` (``transpose``) then ``aten.matmul``
* ``torch._grouped_mm(rows, W.transpose(-2, -1), offs=offsets)``, rows sorted by expert
  (torchtitan's ``GroupedExperts``, transformers' grouped experts) -> ``aten._grouped_mm``
  on the whole stack, every expert at once: no pick is needed, the chain may be empty;
  transformers' own fallback for it (``transformers::grouped_mm_fallback``, what its default
  experts implementation runs where ``_grouped_mm`` cannot: on CPU under export or compile in
  float32) takes the same operands and is the same site

An :class:`ExpertSite` is one such matmul. Its weight operand is reached from the
parameter through a chain of single-use ops that pick experts (index or select on
dim 0), transpose, or cast; following the chain tells which parameter dim is the
matmul's output dim and which its contracted input dim. Propagation then treats
the site like a linear: colwise cuts the parameter's output dim over tp, rowwise
its input dim, so every expert is a clean block (FSDP cuts the expert dim 0, tp
one of the others) and the parameter keeps the layout the user stores.

A parameter is an expert weight only if every use of it is such a chain and all
its sites agree on which dims are ``out`` and ``in``; otherwise it is left alone
(replicated over tp).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

aten = torch.ops.aten

# _grouped_mm reads each operand's rows at 16-byte aligned strides: a rank's share of a cut dim
# must be a multiple of 16 bytes (8 bf16 elements)
_GROUPED_MM_ALIGNMENT = 16
# ops computing ``_grouped_mm(rows [M, in], W [E, in, out], offs)`` by other kernels, by qualified
# name (their library registers them only once imported); none needs _grouped_mm's alignment
_GROUPED_MM_EQUIVALENTS = frozenset({"transformers::grouped_mm_fallback"})
_CASTS = (aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.alias.default, aten.clone.default)


@dataclasses.dataclass(frozen=True)
class ExpertSite:
    """One matmul ``node`` reading an expert weight of parameter ``weight_fqn``.

    ``chain`` are the nodes from the parameter read to the matmul's weight
    operand (exclusive of the parameter, inclusive of the operand); each is used
    only by the next. ``out_dim`` / ``in_dim`` are the parameter's dims the
    matmul produces and contracts; ``input_dim`` is the contracted dim of
    ``input`` and ``output_dim`` the dim of the result that ``out_dim`` becomes.
    ``chain_dims`` maps, per chain node, each of its dims to the parameter dim it
    comes from (``None`` for a dim indexing created).
    """

    node: fx.Node
    input: fx.Node
    weight_fqn: str
    weight_node: fx.Node
    chain: tuple[fx.Node, ...]
    chain_dims: tuple[tuple[int | None, ...], ...]
    out_dim: int
    in_dim: int
    input_dim: int
    output_dim: int
    out_features: int
    in_features: int
    multiple: int = 1  # each rank's share of the cut dim must be a multiple of this many elements
    kernel: str = ""  # the op that needs it

    @property
    def output(self) -> fx.Node:
        return self.node

    @property
    def param_fqns(self) -> tuple[str, ...]:
        return (self.weight_fqn,)

    def dim_in_chain(self, node: fx.Node, param_dim: int) -> int:
        """The dim of chain ``node`` (or the parameter read) that is the parameter's ``param_dim``."""
        if node is self.weight_node:
            return param_dim
        return self.chain_dims[self.chain.index(node)].index(param_dim)


def find_expert_sites(gm: fx.GraphModule, param_shapes: dict[str, tuple[int, ...]]) -> tuple[ExpertSite, ...]:
    """Every expert site of ``gm``, in graph order."""
    by_param: dict[str, list[ExpertSite]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or len(param_shapes.get(node.target, ())) < 3:
            continue
        sites = [_site_from(node, user, param_shapes[node.target]) for user in node.users]
        if node.users and all(sites) and len({(s.out_dim, s.in_dim) for s in sites}) == 1:
            by_param[node.target] = sites
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return tuple(sorted((s for sites in by_param.values() for s in sites), key=lambda s: order[s.node]))


def _site_from(param: fx.Node, first: fx.Node, shape: tuple[int, ...]) -> ExpertSite | None:
    """Follow single-use expert picks, transposes and casts from ``first`` to a matmul."""
    dims: tuple[int | None, ...] = tuple(range(len(shape)))
    chain, chain_dims, node, operand = [], [], first, param
    while True:
        picked = _dims_after(node, operand, dims)
        if picked is None:
            return _matmul_site(param, node, operand, dims, tuple(chain), tuple(chain_dims), shape)
        if len(node.users) != 1:
            return None
        dims = picked
        chain.append(node)
        chain_dims.append(dims)
        operand, node = node, next(iter(node.users))


def _dims_after(node: fx.Node, operand: fx.Node, dims: tuple) -> tuple | None:
    """The parameter dims of ``node``'s result, if ``node`` picks experts, transposes or casts."""
    if node.op != "call_function" or not node.args or node.args[0] is not operand:
        return None
    if node.target == aten.index.Tensor:
        indices = node.args[1]
        if len(indices) != 1 or not isinstance(indices[0], fx.Node) or dims[0] != 0:
            return None
        index_ndim = example_value(indices[0]).dim()
        return (None,) * index_ndim + dims[1:]
    if node.target == aten.select.int and node.args[1] == 0 and dims[0] == 0:
        return dims[1:]
    if node.target == aten.transpose.int:
        a, b = (d % len(dims) for d in node.args[1:3])
        swapped = list(dims)
        swapped[a], swapped[b] = swapped[b], swapped[a]
        return tuple(swapped)
    if node.target in (aten.t.default, aten.numpy_T.default) and len(dims) == 2:
        return dims[::-1]
    if node.target == aten.permute.default:
        return tuple(dims[d % len(dims)] for d in node.args[1])
    if node.target in _CASTS:
        return dims
    return None


def _matmul_site(param, node, operand, dims, chain, chain_dims, shape) -> ExpertSite | None:
    """The site if ``node`` multiplies the expert weight ``operand`` (parameter dims ``dims``)."""
    if node.op != "call_function":
        return None
    args = node.args
    if node.target == aten._grouped_mm.default or _op_name(node) in _GROUPED_MM_EQUIVALENTS:
        return _grouped_site(param, node, operand, dims, chain, chain_dims, shape)
    if not chain and not (node.target == aten.bmm.default and len(dims) == 3 and args[1] is operand):
        # the whole parameter read by a plain matmul is no expert pick; a bmm of [E, rows, in] by the
        # whole [E, in, out] is every expert at once, expert e on batch e (Llama-4's experts)
        return None
    if node.target == aten.linear.default and len(dims) == 2 and args[1] is operand and args[0] is not operand:
        if len(args) > 2 and args[2] is not None:
            return None  # an expert bias: not handled, the weight stays replicated
        x, out_dim, in_dim, input_dim, output_dim = args[0], dims[0], dims[1], -1, -1
    elif node.target in (aten.bmm.default, aten.matmul.default) and len(args) == 2 and len(dims) >= 2:
        if args[0] is operand and args[1] is not operand:  # W @ x: W [..., out, in], x [..., in, n]
            x, out_dim, in_dim, input_dim, output_dim = args[1], dims[-2], dims[-1], -2, -2
        elif args[1] is operand and args[0] is not operand:  # x @ W: W [..., in, out]
            x, out_dim, in_dim, input_dim, output_dim = args[0], dims[-1], dims[-2], -1, -1
        else:
            return None
    else:
        return None
    return _site(param, node, x, operand, dims, chain, chain_dims, shape, (out_dim, in_dim, input_dim, output_dim))


def _grouped_site(param, node, operand, dims, chain, chain_dims, shape) -> ExpertSite | None:
    """``_grouped_mm(rows [M, in], W [E, in, out], offs)``: expert ``e`` multiplies its run of
    rows. Only the 2-D x 3-D form is an expert site (the other forms group both operands, or
    group by ``offs`` over the contracted dim); the offsets and the rows' order stay replicated."""
    rows = node.args[0]
    if len(node.args) < 2 or node.args[1] is not operand or rows is operand or len(dims) != 3 or dims[0] != 0:
        return None
    if not isinstance(rows, fx.Node) or example_value(rows).dim() != 2:
        return None
    if len(node.args) > 3 and node.args[3] is not None or node.kwargs.get("bias") is not None:
        return None  # an expert bias: not handled, the weight stays replicated
    site = _site(param, node, rows, operand, dims, chain, chain_dims, shape, (dims[2], dims[1], -1, -1))
    if node.target != aten._grouped_mm.default:
        return site
    itemsize = example_value(operand).dtype.itemsize
    return site and dataclasses.replace(site, multiple=max(1, _GROUPED_MM_ALIGNMENT // itemsize), kernel="_grouped_mm")


def example_value(node: fx.Node):
    """``node``'s example value; for a node a later pass added without one (a tp collective, which
    keeps the shape but for its cut dim), the value of its first input: enough for the rows and the
    number of dims that finding sites on emitted code reads."""
    while "val" not in node.meta and node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.meta.get("val")


def _op_name(node: fx.Node) -> str:
    """``library::name`` of an operator overload, else ``""``."""
    schema = getattr(node.target, "_schema", None)
    return schema.name if schema is not None else ""


def _site(param, node, x, operand, dims, chain, chain_dims, shape, where) -> ExpertSite | None:
    """The site once the matmul's form told ``where``: (out_dim, in_dim, input_dim, output_dim)."""
    out_dim, in_dim, input_dim, output_dim = where
    if not isinstance(x, fx.Node) or out_dim in (None, 0) or in_dim in (None, 0):
        return None
    x_ndim, out_ndim = example_value(x).dim(), example_value(node).dim()
    return ExpertSite(
        node=node,
        input=x,
        weight_fqn=param.target,
        weight_node=param,
        chain=chain,
        chain_dims=chain_dims,
        out_dim=out_dim,
        in_dim=in_dim,
        input_dim=input_dim % x_ndim,
        output_dim=output_dim % out_ndim,
        out_features=shape[out_dim],
        in_features=shape[in_dim],
    )
