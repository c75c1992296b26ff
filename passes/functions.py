"""Custom ``torch.autograd.Function`` s: inlined when their backward is autograd's.

Capture (``torch.export``) traces a Function's forward into the graph and drops
its hand-written backward; the sharded model then differentiates the traced
forward. That is exact exactly when the Function's backward equals autograd of
its forward, so each Function the model applies is checked before planning, on
the inputs it really receives: one eager forward of the model on the example
inputs records each Function's first call, and for each the two gradients
(hand-written and autograd of ``forward``) are compared for one random output
gradient. A Function that passes is inlined and named in the plan with the
measured difference; one that does not (a straight-through estimator, a
gradient clipped by hand) is refused with that difference. A model on the meta
device has no values: its Functions are checked on random inputs of the
traced shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback

import torch
import torch.utils._pytree as pytree

from autoshard.core.errors import user_frame

TOLERANCE = 1e-4  # max |hand-written - autograd| / max |autograd|, over all input gradients


@dataclasses.dataclass(frozen=True)
class CheckedFunction:
    """A Function the model applies, checked and inlined."""

    name: str
    where: str
    error: float

    def __str__(self) -> str:
        return (
            f"autograd.Function {self.name} at {self.where} inlined: its backward matches autograd of its "
            f"forward (max rel diff {self.error:.1e})"
        )


@dataclasses.dataclass
class _Call:
    cls: type
    args: tuple
    where: str


@contextlib.contextmanager
def recording_calls(calls: list[_Call], *, clone: bool):
    """Record the first call of each user-defined Function while the model runs."""
    original = torch.autograd.Function.apply.__func__
    seen: set[type] = {c.cls for c in calls}

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith("torch.") and cls not in seen:
            seen.add(cls)
            kept = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone() if clone else _shape_of(t), args)
            calls.append(_Call(cls, kept, user_frame(traceback.extract_stack())))
        return original(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = classmethod(original)


def check_functions(calls: list[_Call], on_meta: bool) -> tuple[CheckedFunction, ...]:
    """Check every recorded call; ``on_meta``: its tensors hold no values, use random ones."""
    checked = []
    for call in calls:
        args = call.args
        if on_meta:
            gen = torch.Generator().manual_seed(0)
            args = pytree.tree_map_only(torch.Tensor, lambda t, gen=gen: _random_like(t, gen), args)
        error = _gradient_difference(call.cls, args)
        if not error <= TOLERANCE:
            raise NotImplementedError(
                f"autoshard: the custom autograd.Function {call.cls.__qualname__} at {call.where} has a backward "
                f"that is not the gradient of its forward (max relative difference {error:.3g} on the model's "
                f"example inputs, tolerance {TOLERANCE:g}); capture keeps only its forward, so the sharded model "
                f"would train with other gradients. Write it without a custom backward, or as a torch.library "
                f"custom op"
            )
        checked.append(CheckedFunction(call.cls.__qualname__, call.where, error))
    return tuple(checked)


def _shape_of(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s (concrete) shape and dtype: all a traced call keeps."""
    shape = [int(s) if not isinstance(s, torch.SymInt) else int(s.node.hint or 2) for s in t.shape]
    return torch.empty(shape, dtype=t.dtype, device="meta")


def _random_like(t: torch.Tensor, gen) -> torch.Tensor:
    """Random values of ``t``'s shape, on the CPU (a meta model's Functions are checked there);
    floating ones in at least float32: the check compares a backward with autograd's gradient,
    and bf16 rounding alone would exceed its tolerance."""
    if t.dtype.is_floating_point:
        return torch.randn(t.shape, generator=gen, device="cpu").to(torch.promote_types(t.dtype, torch.float32))
    return torch.zeros(t.shape, dtype=t.dtype, device="cpu")


class _Ctx:
    """What ``forward(ctx, ...)`` may call on its context when run as plain autograd."""

    def __init__(self, num_inputs: int):
        self.saved_tensors = ()
        self.needs_input_grad = (True,) * num_inputs

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_dirty(self, *args):
        pass

    def mark_non_differentiable(self, *args):
        pass

    def set_materialize_grads(self, value):
        pass


def _gradient_difference(cls, args: tuple) -> float:
    inputs = [a for a in args if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())]
    if not inputs:
        return 0.0

    def leaves():
        made = {id(a): a.detach().clone().requires_grad_(True) for a in inputs}
        return tuple(made[id(a)] if id(a) in made else a for a in args), [made[id(a)] for a in inputs]

    custom_args, custom_inputs = leaves()
    custom_out = cls.apply(*custom_args)
    reference_args, reference_inputs = leaves()
    with torch.enable_grad():
        if _new_style(cls):
            reference_out = cls.forward(*reference_args)
        else:
            reference_out = cls.forward(_Ctx(len(args)), *reference_args)
    outs = [o for o in pytree.tree_leaves(custom_out) if isinstance(o, torch.Tensor) and o.requires_grad]
    refs = [o for o in pytree.tree_leaves(reference_out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if len(outs) != len(refs) or not outs:
        return float("inf") if len(outs) != len(refs) else 0.0
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(o.shape, generator=gen, device="cpu").to(o.device, o.dtype) for o in outs]
    custom = torch.autograd.grad(outs, custom_inputs, grads, allow_unused=True)
    reference = torch.autograd.grad(refs, reference_inputs, grads, allow_unused=True)
    worst = 0.0
    for got, want in zip(custom, reference, strict=True):
        if got is None and want is None:
            continue
        if got is None or want is None:
            got = torch.zeros_like(want) if got is None else got
            want = torch.zeros_like(got) if want is None else want
        scale = want.detach().abs().max().clamp_min(1e-30)
        worst = max(worst, ((got - want).abs().max() / scale).item())
    return worst


def _new_style(cls) -> bool:
    """``forward(*args)`` with a separate ``setup_context`` (no ctx argument)."""
    base = torch.autograd.function._SingleLevelFunction.setup_context
    return getattr(cls.setup_context, "__func__", cls.setup_context) is not getattr(base, "__func__", base)
