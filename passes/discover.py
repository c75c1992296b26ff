"""Discover: find the linear and embedding sites of a captured graph.

Pure analysis, nothing is rewritten. A *linear site* is one ATen node computing
``x @ W (+ b)`` with ``W`` a 2-D parameter, whichever way the user wrote it:

* ``nn.Linear`` / ``F.linear``      -> ``aten.linear(x, W[out, in], b)``
* ``x @ W`` / ``torch.matmul(x, W)``  -> ``aten.matmul(x, W[in, out])``
* ``x @ W.t()`` (or ``.T``, ``transpose(0, 1)``) -> ``aten.matmul(x, aten.t(W[out, in]))``
* ``torch.mm`` / ``torch.addmm(b, x, W)`` and ``x @ W + b`` with ``b`` a 1-D
  parameter of the output size (the bias is folded into the site).
* any of these on ``W`` cast first (``F.linear(x.float(), self.weight.float())``, as MoE
  routers compute in float32): the cast is the site's, and the rewrite casts the stored weight.

The site records the weight's *orientation* as the user stores it, so the
transpose pass knows which weights must be stored transposed.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
import torch.fx as fx

from autoshard.core.errors import describe
from autoshard.passes.experts import ExpertSite, find_expert_sites

aten = torch.ops.aten

OUT_IN = "out_in"  # W[out, in], y = x @ W.T  (nn.Linear)
IN_OUT = "in_out"  # W[in, out], y = x @ W    (Conv1D, raw `x @ W`)

_MATMULS = (aten.matmul.default, aten.mm.default)
_TRANSPOSES = (aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default)


@dataclasses.dataclass(frozen=True)
class LinearSite:
    """One ``y = x @ W (+ b)`` in the graph.

    ``node`` computes ``x @ W`` (and the bias, for ``linear``/``addmm``);
    ``output`` is the node whose value is the full ``y`` (``node`` itself, or
    the folded ``add`` of a bias). ``nodes`` are all graph nodes the site owns
    and the rewrite replaces.
    """

    node: fx.Node
    input: fx.Node
    output: fx.Node
    weight_fqn: str
    weight_node: fx.Node
    orientation: str
    in_features: int
    out_features: int
    bias_fqn: str | None = None
    bias_node: fx.Node | None = None
    nodes: tuple[fx.Node, ...] = ()
    weight_cast: fx.Node | None = None  # a dtype cast between the parameter and the matmul

    @property
    def param_fqns(self) -> tuple[str, ...]:
        return (self.weight_fqn,) + ((self.bias_fqn,) if self.bias_fqn else ())


@dataclasses.dataclass(frozen=True)
class EmbeddingSite:
    """One ``aten.embedding(W[num, dim], ids)``: a lookup, i.e. ``one_hot(ids) @ W``."""

    node: fx.Node
    weight_fqn: str
    weight_node: fx.Node
    num_embeddings: int
    embedding_dim: int

    @property
    def param_fqns(self) -> tuple[str, ...]:
        return (self.weight_fqn,)


Site = LinearSite | EmbeddingSite


@dataclasses.dataclass(frozen=True)
class Sites:
    """All sites of a graph, in graph order.

    ``tied`` are the weights read by one embedding and one linear (an input
    embedding tied to the LM head): one tensor, two uses, one layout. ``shared``
    are the weights several linear sites read alike (a module called twice: DiT's
    timestep embedder reused by its output head, ALBERT's one layer run N times):
    one colwise/rowwise decision, made at the first read and kept at the others.
    """

    linears: tuple[LinearSite, ...]
    embeddings: tuple[EmbeddingSite, ...]
    tied: frozenset[str] = frozenset()
    # matmuls reading one expert of a stacked [E, ...] parameter (see passes.experts)
    experts: tuple[ExpertSite, ...] = ()
    shared: frozenset[str] = frozenset()

    @property
    def all(self) -> tuple[Site, ...]:
        return (*self.linears, *self.embeddings)


def param_node_fqn(node: fx.Node, param_fqns) -> str | None:
    if node.op == "get_attr" and node.target in param_fqns:
        return node.target
    return None


_CASTS = (aten._to_copy.default, aten.to.dtype)


def _uncast(arg) -> tuple[object, fx.Node | None]:
    """(the value, the cast) when ``arg`` is a single-use dtype cast of a parameter read, else (arg, None)."""
    if (isinstance(arg, fx.Node) and arg.target in _CASTS and len(arg.users) == 1 and isinstance(arg.args[0], fx.Node)
            and arg.args[0].op == "get_attr" and set(arg.kwargs) <= {"dtype"}):
        return arg.args[0], arg
    return arg, None


def _weight_of(arg, param_shapes) -> tuple[fx.Node, str, str, fx.Node | None] | None:
    """(get_attr node, fqn, orientation, cast) if ``arg`` is a 2-D parameter used as matmul rhs,
    read as stored or through one dtype cast (``x.float() @ w.float().T``)."""
    if not isinstance(arg, fx.Node):
        return None
    w, cast = _uncast(arg)
    fqn = param_node_fqn(w, param_shapes)
    if fqn is not None and len(param_shapes[fqn]) == 2:
        return w, fqn, IN_OUT, cast
    if arg.target in _TRANSPOSES and isinstance(arg.args[0], fx.Node):
        w, cast = _uncast(arg.args[0])
        fqn = param_node_fqn(w, param_shapes)
        if fqn is None or len(param_shapes[fqn]) != 2:
            return None
        if arg.target == aten.transpose.int and sorted(d % 2 for d in arg.args[1:3]) != [0, 1]:
            return None
        if arg.target == aten.permute.default and [d % 2 for d in arg.args[1]] != [1, 0]:
            return None
        return w, fqn, OUT_IN, cast
    return None


def _bias_of(arg, param_shapes, out_features) -> tuple[fx.Node, str] | None:
    if not isinstance(arg, fx.Node):
        return None
    fqn = param_node_fqn(arg, param_shapes)
    if fqn is not None and param_shapes[fqn] == (out_features,):
        return arg, fqn
    return None


def find_linear_sites(gm: fx.GraphModule, param_shapes: dict[str, tuple[int, ...]]) -> tuple[LinearSite, ...]:
    sites = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == aten.linear.default:
            x, (w, cast) = node.args[0], _uncast(node.args[1])
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            fqn = param_node_fqn(w, param_shapes) if isinstance(w, fx.Node) else None
            if fqn is None or len(param_shapes[fqn]) != 2:
                continue
            out_f, in_f = param_shapes[fqn]
            b = _bias_of(bias, param_shapes, out_f) if bias is not None else None
            if bias is not None and b is None or cast is not None and bias is not None:
                continue
            owned = (node,) + ((cast,) if cast is not None else ())
            sites.append(_site(node, x, node, w, fqn, OUT_IN, in_f, out_f, b, owned, cast))
        elif node.target in _MATMULS or node.target == aten.addmm.default:
            is_addmm = node.target == aten.addmm.default
            x, rhs = (node.args[1], node.args[2]) if is_addmm else (node.args[0], node.args[1])
            weight = _weight_of(rhs, param_shapes)
            if weight is None or not isinstance(x, fx.Node) or _is_param(x, param_shapes):
                continue
            w, fqn, orientation, cast = weight
            shape = param_shapes[fqn]
            in_f, out_f = shape if orientation == IN_OUT else shape[::-1]
            owned = (node,) + ((rhs,) if rhs is not w and rhs is not cast else ()) + ((cast,) if cast else ())
            output, bias = node, None
            if cast is not None and is_addmm:
                continue
            if is_addmm:
                if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                    continue
                bias = _bias_of(node.args[0], param_shapes, out_f)
                if bias is None:
                    continue
            elif len(node.users) == 1:
                (user,) = node.users
                if user.target == aten.add.Tensor and user.args[0] is node and user.kwargs.get("alpha", 1) == 1:
                    bias = _bias_of(user.args[1], param_shapes, out_f)
                    if bias is not None:
                        output, owned = user, owned + (user,)
            if cast is not None and bias is not None:
                continue
            sites.append(_site(node, x, output, w, fqn, orientation, in_f, out_f, bias, owned, cast))
    return tuple(sites)


def _site(node, x, output, w, fqn, orientation, in_f, out_f, bias, owned, cast=None) -> LinearSite:
    b_node, b_fqn = bias if bias is not None else (None, None)
    return LinearSite(node, x, output, fqn, w, orientation, in_f, out_f, b_fqn, b_node, owned, cast)


def _is_param(node, param_shapes) -> bool:
    return isinstance(node, fx.Node) and param_node_fqn(node, param_shapes) is not None


def find_embedding_sites(gm: fx.GraphModule, param_shapes) -> tuple[EmbeddingSite, ...]:
    sites = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == aten.embedding.default:
            fqn = param_node_fqn(node.args[0], param_shapes)
            if fqn is not None and len(param_shapes[fqn]) == 2:
                num, dim = param_shapes[fqn]
                sites.append(EmbeddingSite(node, fqn, node.args[0], num, dim))
    return tuple(sites)


def find_sites(gm: fx.GraphModule, param_shapes: dict[str, tuple[int, ...]]) -> Sites:
    """All sites. A parameter may feed one site, several linears that read it alike (same
    orientation, same bias), or be an embedding table shared by lookups and at most one bias-free
    ``[out, in]`` linear (tied to the LM head when there is one); any other sharing of a sharded
    weight has no single layout valid for all its uses and is an error."""
    linears, embeddings = find_linear_sites(gm, param_shapes), find_embedding_sites(gm, param_shapes)
    owners: dict[str, list[Site]] = defaultdict(list)
    for site in (*linears, *embeddings):
        for fqn in site.param_fqns:
            owners[fqn].append(site)
    tied, shared = set(), set()
    for fqn, users in owners.items():
        if len(users) == 1:
            continue
        if _read_alike(users):
            shared.update(users[0].param_fqns)
            continue
        if _is_tied_pair(fqn, users):
            if any(isinstance(u, LinearSite) for u in users):
                tied.add(fqn)  # vocabulary-parallel; lookups alone share the embedding dim's cut
            continue
        where = "; ".join(describe(s.node) for s in users)
        raise NotImplementedError(
            f"autoshard: parameter '{fqn}' (shape {list(param_shapes[fqn])}) is used by "
            f"{len(users)} linear/embedding ops ({where}); only an embedding table shared by lookups "
            f"and at most one linear (an LM head), or linears reading the weight and its bias alike, can share a weight"
        )
    _check_params_used_only_by_their_site(gm, owners)
    return Sites(linears, embeddings, frozenset(tied), find_expert_sites(gm, param_shapes), frozenset(shared))


def _read_alike(users: list) -> bool:
    """Linear sites reading one weight the same way: the same orientation and the same bias (or
    none), so one role, one stored layout and one bias placement serve every read."""
    if not all(isinstance(u, LinearSite) for u in users):
        return False
    first = users[0]
    return all((u.weight_fqn, u.orientation, u.bias_fqn) == (first.weight_fqn, first.orientation, first.bias_fqn)
               for u in users)


def _is_tied_pair(fqn: str, users: list) -> bool:
    """An embedding table shared by lookups (an encoder-decoder's encoder and decoder) and at most
    one bias-free ``[out, in]`` linear (the LM head): one layout serves all its uses."""
    lookups = [u for u in users if isinstance(u, EmbeddingSite)]
    linears = [u for u in users if isinstance(u, LinearSite)]
    if not lookups or len(linears) > 1 or len(lookups) + len(linears) != len(users):
        return False
    return all(linear.orientation == OUT_IN and linear.weight_fqn == fqn for linear in linears)


def _check_params_used_only_by_their_site(gm: fx.GraphModule, owners) -> None:
    """A site's weight must feed only that site: the rewrite replaces all its uses."""
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in owners:
            continue
        own = set()
        for site in owners[node.target]:
            own |= set(site.nodes) if isinstance(site, LinearSite) else {site.node}
        users = set(node.users) | {u for t in node.users if t.target in _TRANSPOSES + _CASTS for u in t.users}
        for user in users - own:
            raise NotImplementedError(
                f"autoshard: parameter '{node.target}' feeds {describe(owners[node.target][0].node)} and also "
                f"{describe(user)}; a sharded weight used outside its linear op is not supported"
            )
