"""Decompose: rewrite an op into ATen primitives whose layout rules keep tp sharding.

A norm over a tp-sharded width (an OLMo-2 q/k norm on ``[b, s, h*d]`` right after
the colwise projection) has no communication-free rule as one op: DTensor
gathers its input. Written out, it is elementwise work on the local shard plus
means over the sharded dim, which are partial sums: each mean is all-reduced
(a few numbers per token, instead of gathering the activation), and the
replicated statistics that then scale the sharded values get their gradient
all-reduced once in backward (:mod:`passes.propagate`'s ``enter_tp`` rule).

* ``rms_norm(x, shape, w, eps)`` -> ``x * rsqrt(mean(x*x) + eps) * w``:
  one statistics all-reduce forward, one backward;
* ``layer_norm(x, shape, w, b, eps)`` -> ``(x - mean(x)) * rsqrt(mean(xc*xc) + eps) * w + b``:
  two forward, two backward (the two-pass variance, as ATen computes it).

In bf16 and fp16 they compute where ATen does: the statistics and the normalized value
in float32, rounded back once (``rms_norm`` before its weight, ``layer_norm`` after its
affine). Written out in the input dtype they would round the statistics too, which
costs a bf16 run about four times one device's error.

The weight and bias span the sharded dim, so they are stored sharded over tp
(role ``sharded``) and their gradients need no communication.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.passes.partition import made_like

aten = torch.ops.aten

NORMS = (aten.rms_norm.default, aten.layer_norm.default)


def decompose_norm(graph: fx.Graph, node: fx.Node) -> None:
    """Rewrite ``node`` (an ``rms_norm``/``layer_norm``) into its primitives, in place:
    ``node`` computes the last of them."""
    x, shape = node.args[0], node.args[1]
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    is_layer = node.target == aten.layer_norm.default
    bias = (node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")) if is_layer else None
    eps = node.args[4 if is_layer else 3] if len(node.args) > (4 if is_layer else 3) else node.kwargs.get("eps")
    x_val = x.meta["val"]
    wide = _computation_dtype(x_val.dtype)
    if eps is None:  # ATen's default: the epsilon of the dtype it computes in, not of the input's
        eps = torch.finfo(wide).eps
    dims = list(range(x_val.dim() - len(shape), x_val.dim()))

    def emit(target, *args):
        new = graph.call_function(target, args)
        metas = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        metas = [torch.empty(m.shape, dtype=m.dtype, device="meta") if isinstance(m, torch.Tensor) else m
                 for m in metas]
        new.meta["val"] = target(*metas)
        made_like(new, node)
        return new

    with graph.inserting_before(node):
        upcast = x if wide == x_val.dtype else emit(aten.to.dtype, x, wide)
        centered = upcast
        if is_layer:
            centered = emit(aten.sub.Tensor, upcast, emit(aten.mean.dim, upcast, dims, True))
        variance = emit(aten.mean.dim, emit(aten.mul.Tensor, centered, centered), dims, True)
        steps = [(aten.mul.Tensor, centered, emit(aten.rsqrt.default, emit(aten.add.Tensor, variance, eps)))]
        if not is_layer and wide != x_val.dtype:  # rms_norm rounds the normalized value, then scales it
            steps.append((aten.to.dtype, None, x_val.dtype))
        if isinstance(weight, fx.Node):
            steps.append((aten.mul.Tensor, None, weight))
        if isinstance(bias, fx.Node):
            steps.append((aten.add.Tensor, None, bias))
        if is_layer and wide != x_val.dtype:  # layer_norm rounds once, after the affine
            steps.append((aten.to.dtype, None, x_val.dtype))
        out = None
        for target, a, b in steps[:-1]:
            out = emit(target, out if a is None else a, b)
    # the norm node itself becomes the last step, so whatever refers to it (a linear site's input) stays valid
    target, a, b = steps[-1]
    node.target, node.args, node.kwargs = target, (out if a is None else a, b), {}


def _computation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ATen's norms compute their statistics in: float32 for bf16 and fp16 inputs."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


SDPA = aten.scaled_dot_product_attention.default


def expand_gqa_for_tp(graph: fx.Graph, tp: int) -> list[fx.Node]:
    """Give grouped-query attention as many k/v heads as q heads where only q's divide by tp.

    ``scaled_dot_product_attention(q, k, v, enable_gqa=True)`` with ``h`` q heads and
    ``kv`` k/v heads reads kv head ``i // (h / kv)`` for q head ``i``. When ``kv`` does not
    divide by tp (2 kv heads on tp=4) k and v cannot be cut on heads, but each rank's q
    heads still need only their own kv heads: ``repeat_interleave(k, h / kv, dim=heads)``
    makes that one head per q head, which tp cuts like q (a cut, no communication forward).
    The result is the same attention. Multi-query attention that lets SDPA broadcast its one
    k/v head over the q heads (Falcon) is the same case with ``kv = 1``. Returns the rewritten
    attention nodes.
    """
    from autoshard.runtime.context_ops import CP_CAUSAL_ATTENTION  # its args: q, k, v, cp, group, scale, enable_gqa

    rewritten = []
    for node in list(graph.nodes):
        cp_attention = node.target is CP_CAUSAL_ATTENTION
        if node.target is not SDPA and not cp_attention:
            continue
        gqa = (len(node.args) > 6 and node.args[6]) if cp_attention else node.kwargs.get("enable_gqa", False)
        q, k, v = node.args[:3]
        shapes = [getattr(t.meta.get("val"), "shape", None) for t in (q, k, v)]
        if any(s is None or len(s) < 3 for s in shapes):
            continue
        heads, kv_heads = shapes[0][-3], shapes[1][-3]
        if not gqa and not (kv_heads == 1 and shapes[2][-3] == 1):
            continue  # without enable_gqa only one kv head broadcast over the q heads (multi-query) is read so
        if not all(isinstance(n, int) for n in (heads, kv_heads)) or heads == kv_heads:
            continue
        if heads % tp or not kv_heads % tp or heads % kv_heads:
            continue
        with graph.inserting_before(node):
            expanded = []
            for t in (k, v):
                rep = graph.call_function(aten.repeat_interleave.self_int, (t, heads // kv_heads, -3))
                made_like(rep, node)
                val = t.meta["val"]
                rep.meta["val"] = val.repeat_interleave(heads // kv_heads, dim=-3)
                rep._rename(f"{t.name}_per_q_head")
                expanded.append(rep)
        if cp_attention:
            node.args = (q, *expanded, *node.args[3:6], False)
        else:
            node.args = (q, *expanded, *node.args[3:])
            node.kwargs = {key: val for key, val in node.kwargs.items() if key != "enable_gqa"}
        rewritten.append(node)
    return rewritten
