"""Capture: an ``nn.Module`` and example inputs to one flat ATen graph.

We capture with ``torch.export.export(strict=False)`` and unlift it
(``ExportedProgram.module()``): parameters and buffers become ``get_attr``
nodes named by their original FQNs, ``nn.Linear`` stays ``aten.linear``, and
every node carries ``meta["val"]`` (shapes), ``nn_module_stack`` and a
``stack_trace``. ATen is the one IR every later pass reads; the torch.compile
backend feeds its dynamo graph through the same export.

The user's model is only read: the captured module refers to the model's own
parameter tensors, and no later pass writes to them.

A model built on the meta device (``with torch.device("meta"):``) is captured
entirely on meta: its example inputs and the buffers the user already filled
(a rotary table) are moved there for tracing, through a twin of the model that
shares its modules' parameters and code. Shapes are all capture needs, and
code that moves tensors to its input's device (``.to(x.device)``, a rotary
``torch.arange(..., device=x.device)``) then never mixes devices. Such graphs
create tensors on ``meta``; materialize rewrites those devices to the mesh's.

A forward that takes ``use_cache`` (Hugging Face decoders and encoder-decoders, whose
config turns it on by default) is captured with ``use_cache=False`` unless the caller
passed it: the cache is an object for generation that training never reads and
``torch.export`` cannot return. The captured module is called as the model was (without
``use_cache``) and returns the model's output type without the cache (``out.logits``,
``out[0]``), as the model does with ``use_cache=False``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import inspect
import itertools
import re
import traceback
import types

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from autoshard.core.errors import user_frame
from autoshard.core.meta_model import parameters_on_meta
from autoshard.passes.filled_buffers import filled_buffers_as_cats
from autoshard.passes.functions import CheckedFunction, check_functions, keeping_whole, recording_calls
from autoshard.passes.mixed_dtypes import buffer_dtype_hint
from autoshard.passes.partition import callable_blocks, made_like
from autoshard.passes.regions import inline_regions
from autoshard.passes.reuse_blocks import find_stack, synthesize, with_two_blocks
from autoshard.passes.specialize import export_specialized, guards_on_data, name_branches, unreported_data_guards


@dataclasses.dataclass(frozen=True)
class InputSignature:
    """Shapes and dtypes of the example inputs, by argument name and pytree path.

    A size is ``None`` where the dim was captured symbolic (``dynamic_shapes``);
    every other size is baked into the graph, so the sharded module checks each
    call against this signature and names the input that differs, instead of
    failing deep inside a reshape.
    """

    tensors: tuple[tuple[str, tuple[int | None, ...], torch.dtype], ...]
    arg_names: tuple[str, ...] = ()
    # keyword arguments capture set for training (``use_cache=False``), baked into the graph
    set_by_capture: tuple[tuple[str, object], ...] = ()

    @classmethod
    def of(cls, args: tuple, kwargs: dict, arg_names: tuple[str, ...] = (), placeholders=None) -> InputSignature:
        leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
        tensors = [(_path_name(path, arg_names), leaf) for path, leaf in leaves if isinstance(leaf, torch.Tensor)]
        vals = [None] * len(tensors) if placeholders is None else placeholders
        return cls(tuple(
            (name, _static_sizes(leaf, val), leaf.dtype) for (name, leaf), val in zip(tensors, vals, strict=True)
        ), arg_names)

    def check(self, module, args, kwargs):
        """Forward pre-hook of the sharded module; returns the call without the keywords
        capture set (see :meth:`without_keywords_set_by_capture`)."""
        kept = self.without_keywords_set_by_capture(kwargs)
        self._check_tensors(args, kept)
        return (tuple(args), kept) if len(kept) != len(kwargs) else None

    def without_keywords_set_by_capture(self, kwargs: dict) -> dict:
        """``kwargs`` without the keywords capture set, which the graph no longer takes. Passing
        the value the graph runs with, or ``None`` (the model's default), is accepted and dropped;
        another value raises: the graph cannot run it."""
        kept = dict(kwargs)
        for name, value in self.set_by_capture:
            given = kept.pop(name, None)
            if given is not None and given != value:
                raise ValueError(
                    f"autoshard: the sharded model always runs with {name}={value!r} (set at capture for "
                    f"training); call it without {name}={given!r}"
                )
        return kept

    def _check_tensors(self, args, kwargs) -> None:
        got = InputSignature.of(tuple(args), dict(kwargs), self.arg_names).tensors
        if len(got) != len(self.tensors):
            raise ValueError(
                f"autoshard: the model was sharded for {len(self.tensors)} tensor inputs "
                f"({', '.join(n for n, _, _ in self.tensors)}); got {len(got)}"
            )
        for (name, shape, dtype), (_, got_shape, got_dtype) in zip(self.tensors, got, strict=True):
            fits = len(shape) == len(got_shape) and all(s in (None, g) for s, g in zip(shape, got_shape, strict=True))
            if not fits or dtype != got_dtype:
                wanted = [s if s is not None else "*" for s in shape]
                raise ValueError(
                    f"autoshard: input {name} has shape {list(got_shape)} ({got_dtype}); the model was "
                    f"sharded for shape {wanted} ({dtype}), '*' marking dynamic dims. Shard again with "
                    f"example_inputs of the new shape, or mark the dim dynamic (dynamic_shapes)"
                )


def _static_sizes(leaf: torch.Tensor, val) -> tuple[int | None, ...]:
    if not isinstance(val, torch.Tensor):
        return tuple(leaf.shape)
    return tuple(None if isinstance(s, torch.SymInt) else int(s) for s in val.shape)


@dataclasses.dataclass(frozen=True)
class CapturedGraph:
    """A flat ATen GraphModule and what later passes need to know of the model.

    ``block_fqns`` are the modules that become one FSDP unit each (see
    :func:`find_blocks`; a block that cannot be one call stays in the root),
    in forward order. A tied parameter (one tensor under several FQNs) is
    read in the graph by its first FQN in ``named_parameters()`` order;
    ``aliases`` maps its other FQNs to that one.
    """

    gm: fx.GraphModule
    param_shapes: dict[str, tuple[int, ...]]
    block_fqns: tuple[str, ...]
    inputs: InputSignature
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)  # tied FQN -> canonical FQN
    functions: tuple[CheckedFunction, ...] = ()  # custom autograd.Functions checked and inlined
    trace_note: str = ""  # why a stack of blocks was traced in full rather than once
    # a stack's block 1 and the blocks written as its copies (reuse_blocks): planned once, stamped on the copies
    written: tuple[str, ...] = ()
    frozen: frozenset[str] = frozenset()  # parameters that do not require grad
    # lines whose data-dependent branch is taken as the example took it, checked at run time (specialize)
    branches: tuple[str, ...] = ()


class CaptureError(ValueError):
    """The model could not be captured as one graph."""


def capture(
    model: nn.Module, args: tuple, kwargs: dict | None = None, dynamic_shapes=None, compute_dtype=None,
    trace_blocks_once: bool = True, buffer_dtype=None, output_dtype=None, cast_inputs: bool = True,
) -> CapturedGraph:
    """``dynamic_shapes`` is ``torch.export``'s: e.g. ``({0: Dim("batch"), 1: Dim("seq")},)``.

    ``compute_dtype`` (mixed precision's ``param_dtype``) captures the forward as it will
    run: on meta, with floating parameters and inputs in that dtype (FSDP2 casts both) and
    buffers as they are. A model that upcasts internally (an RMSNorm in float32, then back
    to its input's dtype) is then captured with the casts it makes at run time, not with
    the float32 it would see in a float32 trace.

    ``trace_blocks_once``: a stack of identical blocks is traced as its first two and the
    rest written from the second (:mod:`autoshard.passes.reuse_blocks`); the graph is the
    one full tracing gives. Blocks that differ, or a forward this cannot follow, are
    traced in full.
    """
    blocks = find_blocks(model)
    kwargs = kwargs or {}
    set_for_training = training_keywords(model, kwargs)
    run_kwargs = {**kwargs, **set_for_training}
    traced, traced_args, traced_kwargs = _traced_twin(model, tuple(args), run_kwargs, blocks, compute_dtype,
                                                      buffer_dtype, output_dtype, cast_inputs)
    stack, trace_note = find_stack(model, blocks) if trace_blocks_once and dynamic_shapes is None else (None, "")
    exported_module = traced
    if stack is not None:
        exported_module = with_two_blocks(_twin(traced, lambda b: b), stack)
    traced_calls = []
    export_shapes = _with_keyword_shapes(dynamic_shapes, model, args, kwargs, set_for_training)

    def export(calls):
        try:
            return _export(model, traced, exported_module, traced_args, traced_kwargs, export_shapes, calls)
        except CaptureError as err:
            raise _with_buffer_hint(err, model, compute_dtype) from err.__cause__

    try:
        exported, failed = export(traced_calls), None
    except CaptureError as err:
        if not traced_calls:
            raise
        exported, failed = None, err  # perhaps a Function the check keeps whole (an alias made with .data)
    on_values = compute_dtype is None and not _on_meta(traced)
    functions = _check_functions(model, args, run_kwargs, traced_calls, on_values)
    if any(f.whole for f in functions):  # traced again, each such Function one op keeping its backward
        with keeping_whole(functions):
            exported = export([])
    elif failed is not None:
        raise failed
    unlifted = exported.module()
    graph = unlifted.graph
    attributes: nn.Module | dict = unlifted
    if stack is not None:
        full_graph, why = synthesize(graph, stack)
        if full_graph is None:  # not a plain stack after all: trace every block
            full = capture(model, args, kwargs, dynamic_shapes, compute_dtype, trace_blocks_once=False,
                           buffer_dtype=buffer_dtype, output_dtype=output_dtype, cast_inputs=cast_inputs)
            return dataclasses.replace(full, trace_note=why)
        graph, attributes = full_graph, _attributes(full_graph, unlifted, traced)
    gm = graph_module(attributes, graph, type(model).__name__)
    inline_regions(gm)  # after the stack is written: the names it gives are not export's numbering
    branches = name_branches(gm.graph, type(model).__name__)
    aliases = _tied_aliases(model)
    _clean(graph, aliases)
    if compute_dtype is not None and output_dtype is not None:
        _cast_outputs(graph, output_dtype)
    in_spec = _drop_keyword_inputs(graph, unlifted._in_spec, set_for_training)
    gm._in_spec, gm._out_spec = in_spec, unlifted._out_spec  # read by the pytree calling convention of the code
    param_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    arg_names = tuple(inspect.signature(model.forward).parameters)
    placeholders = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    placeholders = [v for v in placeholders if isinstance(v, torch.Tensor)]
    inputs = InputSignature.of(tuple(args), kwargs, arg_names, placeholders)
    inputs = dataclasses.replace(inputs, set_by_capture=tuple(set_for_training.items()))
    written = tuple(stack.block(k) for k in range(1, stack.count)) if stack is not None else ()
    frozen = frozenset(name for name, p in model.named_parameters() if not p.requires_grad)
    return CapturedGraph(gm, param_shapes, callable_blocks(gm, blocks), inputs, aliases, functions, trace_note,
                         written, frozen, branches)


# Keywords whose default serves inference, and the value training runs with: a Hugging Face
# decoder returns its KV cache (``use_cache``, on in its config by default), an object
# ``torch.export`` cannot return and that no training step reads.
TRAINING_KEYWORDS = {"use_cache": False}


def training_keywords(model: nn.Module, kwargs: dict) -> dict:
    """The :data:`TRAINING_KEYWORDS` ``model.forward`` takes by name and the caller left out:
    capture runs the forward with them, and the sharded module always runs so."""
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward Python cannot describe: nothing is set
        return {}
    return {name: value for name, value in TRAINING_KEYWORDS.items() if name in names and name not in kwargs}


def _with_keyword_shapes(dynamic_shapes, model: nn.Module, args: tuple, kwargs: dict, added: dict):
    """``dynamic_shapes`` with a ``None`` (static) entry for each keyword capture added, where
    the caller's spec is a tuple of per-argument specs (in the forward's order) or a dict by name."""
    if dynamic_shapes is None or not added:
        return dynamic_shapes
    if isinstance(dynamic_shapes, dict):
        return {**dynamic_shapes, **dict.fromkeys(added)}
    if not isinstance(dynamic_shapes, (tuple, list)):
        return dynamic_shapes  # keyed by tensor (ShapesCollection): a bool needs no entry
    shapes = list(dynamic_shapes)
    for position, name in enumerate(inspect.signature(model.forward).bind(*args, **kwargs, **added).arguments):
        if name in added:
            shapes.insert(position, None)
    return type(dynamic_shapes)(shapes)


def _drop_keyword_inputs(graph: fx.Graph, in_spec, added: dict):
    """Take the keywords capture added out of the graph's calling convention: their placeholders
    (export bakes a bool into the code, which never reads it) and their entries in ``in_spec``.
    The captured module is then called as the caller called the model. Returns the new spec."""
    if not added:
        return in_spec
    leaves = [object() for _ in range(in_spec.num_leaves)]
    args, kwargs = pytree.tree_unflatten(leaves, in_spec)
    dropped = {id(kwargs.pop(name)) for name in added}
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    for leaf, node in zip(leaves, placeholders, strict=True):
        if id(leaf) in dropped:
            graph.erase_node(node)
    spec = pytree.tree_structure((args, kwargs))
    info = graph._codegen.pytree_info
    graph._codegen = _PyTreeCodeGen(_PyTreeInfo([a for a in info.orig_args if a not in added], spec, info.out_spec))
    return spec


def _traced_twin(model: nn.Module, args: tuple, kwargs: dict, blocks, compute_dtype, buffer_dtype=None,
                 output_dtype=None, cast_inputs: bool = True):
    """The module export traces and its inputs: always a twin (:func:`_twin`), so that what the
    forward writes to its modules while traced (a buffer registered on first call, a cached
    table, a counter) lands on the twin and the user's model is left as it was. Under mixed
    precision its floating parameters and inputs are in ``compute_dtype`` (see
    :func:`_parameters_as`), and its floating buffers in ``buffer_dtype`` when one is given; each
    FSDP unit casts as the policy says (:func:`_cast_units`). A model on meta gets a twin with its
    buffers on meta too."""
    if compute_dtype is not None:
        on_meta = parameters_on_meta(model)
        move = _to_meta if on_meta else _unchanged
        buffers = move if buffer_dtype is None else (
            lambda b: move(b).to(buffer_dtype) if b.is_floating_point() else move(b))
        traced = _twin(model, buffers, _parameters_as(compute_dtype, on_meta))
        inputs_to = compute_dtype if cast_inputs else None
        _cast_units(traced, blocks, inputs_to, output_dtype)
        # the model's own FSDP unit casts its inputs before export sees them, and its outputs in
        # the graph (:func:`_cast_outputs`): export runs the root's forward, not its hooks
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: _floating_to(move(t), inputs_to), (args, kwargs),
        )
        return traced, args, kwargs
    if parameters_on_meta(model):
        args, kwargs = pytree.tree_map_only(torch.Tensor, _to_meta, (args, kwargs))
        return _twin_on_meta(model), args, kwargs
    return _twin(model, _unchanged), args, kwargs


def _export(model, traced, exported_module, args, kwargs, dynamic_shapes, traced_calls):
    """``torch.export`` (non-strict) of ``exported_module``, recording the custom autograd
    Functions it calls; any failure but a ``NotImplementedError`` becomes one ``CaptureError``."""
    try:
        # a twin on meta also creates the tensors its forward makes without `device=` on meta
        # (a rotary `torch.arange(n)`), or they would meet meta tensors on the CPU
        on_meta = torch.device("meta") if _on_meta(traced) else contextlib.nullcontext()
        with recording_calls(traced_calls, clone=False), on_meta:
            with unreported_data_guards() as stop:
                try:
                    return torch.export.export(exported_module, args, kwargs, dynamic_shapes=dynamic_shapes,
                                               strict=False)
                except Exception as err:
                    if _on_meta(traced) or not guards_on_data(err):
                        raise
                    stop.handled, stopped = True, err
            traced_calls.clear()  # traced again
            exported = export_specialized(exported_module, args, kwargs, dynamic_shapes)
            if exported is None:
                raise stopped
            return exported
    except NotImplementedError:
        raise
    except Exception as err:  # export raises many types; the user needs one
        cache = _cache_in_output(err)
        if cache is not None:
            raise CaptureError(
                f"autoshard: {type(model).__name__} returns its KV cache ({cache}, for generation), which "
                f"torch.export cannot capture: pass use_cache=False or set model.config.use_cache = False"
            ) from err
        raise CaptureError(
            f"autoshard: could not capture {type(model).__name__} with torch.export "
            f"(strict=False) at {user_frame(traceback.extract_tb(err.__traceback__))}: "
            f"{type(err).__name__}: {_first_lines(str(err))}"
        ) from err


def _with_buffer_hint(err: CaptureError, model: nn.Module, compute_dtype) -> CaptureError:
    hint = buffer_dtype_hint(model, compute_dtype) if "dtype" in str(err) else ""
    return CaptureError(f"{err}{hint}") if hint else err


def _cache_in_output(err: Exception) -> str | None:
    """The class name of a KV cache object export found among the outputs, if that is what failed
    (a forward that takes ``use_cache`` only through ``**kwargs``, or was passed ``use_cache=True``)."""
    found = re.search(r"Found <class '([\w.]+)'> in output", str(err))
    name = found.group(1).rsplit(".", 1)[-1] if found else ""
    return name if name.endswith("Cache") else None


def _clean(graph: fx.Graph, aliases) -> None:
    """Drop export's guards and dtype asserts, read each tied parameter by one name, write a buffer
    filled by slice copies as the cat it is (:mod:`autoshard.passes.filled_buffers`), and remove what
    nothing uses."""
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
        elif node.target is torch.ops.aten._assert_tensor_metadata.default:
            # export's check before each `.to`: under mixed precision FSDP2 already cast what
            # the check would expect uncast (a block's inputs), and the `.to` stays a no-op
            graph.erase_node(node)
    _read_tied_parameters_by_one_name(graph, aliases)
    filled_buffers_as_cats(graph)
    graph.eliminate_dead_code()


def _to_meta(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("meta")


def _unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def _twin_on_meta(model: nn.Module) -> nn.Module:
    """``model``'s module tree, shallow-copied, with the same parameters and every buffer on meta."""
    return _twin(model, _to_meta)


def _attributes(graph: fx.Graph, unlifted: nn.Module, traced: nn.Module) -> dict:
    """What the written graph's ``get_attr``/``call_module`` nodes read: the exported module's
    (constants, the first two blocks) and, for the written blocks, the traced model's."""
    found = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            for source in (unlifted, traced):
                try:
                    found[node.target] = _fetch(source, node.target)
                    break
                except AttributeError:
                    continue
    return found


def _fetch(module: nn.Module, target: str):
    value = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _parameters_as(dtype: torch.dtype, on_meta: bool):
    """Each parameter in ``dtype`` when floating, as FSDP2's mixed precision runs it; one per
    original, so a tied parameter stays tied. A model with weights gets real copies: its forward
    then runs on its own device, and a tensor it makes from data (``torch.tensor(d ** 0.5)``, an
    index list, a mask value made ``device=x.device``) is captured with its value, which a twin on
    meta would lose. A model on meta gets meta parameters."""
    made: dict[int, nn.Parameter] = {}

    def convert(param: nn.Parameter) -> nn.Parameter:
        if id(param) not in made:
            target = dtype if param.is_floating_point() else param.dtype
            value = torch.empty_like(param, device="meta", dtype=target) if on_meta else param.detach().to(target)
            made[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
        return made[id(param)]

    return convert


def _floating_to(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _cast_outputs(graph: fx.Graph, dtype: torch.dtype) -> None:
    """Cast the graph's floating outputs to ``dtype``: the model's own FSDP unit's ``output_dtype``."""
    output = graph.output_node()

    def cast(value):
        val = value.meta.get("val") if isinstance(value, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or val.dtype == dtype:
            return value
        with graph.inserting_before(output):
            node = graph.call_function(torch.ops.aten.to.dtype, (value, dtype))  # as export records `.to`
        made_like(node, value)
        node.meta["val"] = val.to(dtype)
        return node

    output.args = fx.node.map_aggregate(output.args, cast)


def _cast_units(twin: nn.Module, blocks: tuple[str, ...], inputs_to: torch.dtype | None,
                outputs_to: torch.dtype | None) -> None:
    """Cast each block's floating inputs to ``inputs_to`` and its floating outputs to
    ``outputs_to``, as FSDP2's mixed precision does at every FSDP unit (rotary tables passed into
    a block arrive in ``param_dtype``; a block that returns float32 hands on ``output_dtype``).
    The hooks go on the twin's own hook dicts, never the user's modules'."""

    def cast_inputs(module, args, kwargs):
        return pytree.tree_map_only(torch.Tensor, lambda t: _floating_to(t, inputs_to), (args, kwargs))

    def cast_outputs(module, args, output):
        return pytree.tree_map_only(torch.Tensor, lambda t: _floating_to(t, outputs_to), output)

    for fqn in blocks:
        block = twin.get_submodule(fqn)
        for name in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_pre_hooks_always_called",
                     "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            if name in block.__dict__:
                setattr(block, name, type(block.__dict__[name])(block.__dict__[name]))
        if inputs_to is not None:
            block.register_forward_pre_hook(cast_inputs, with_kwargs=True)
        if outputs_to is not None:
            block.register_forward_hook(cast_outputs)


_CONTAINERS = (dict, list, set, collections.OrderedDict)
_MODULE_STATE = ("_modules", "_parameters", "_buffers")


def _twin(model: nn.Module, buffer_fn, param_fn=None) -> nn.Module:
    """``model``'s module tree, shallow-copied, with the same parameters (or ``param_fn`` of each)
    and ``buffer_fn`` of each buffer. The user's modules are not touched: each twin gets its own
    ``_modules``, ``_buffers`` (and ``_parameters``) dicts, and copies of the other dicts, lists
    and sets it holds. A module reachable under two names stays one twin.
    """
    twins: dict[int, nn.Module] = {}

    def twin(module: nn.Module) -> nn.Module:
        if id(module) not in twins:
            # a bare copy of the instance: copy.copy refuses parametrized modules (weight norm)
            clone = twins[id(module)] = type(module).__new__(type(module))
            clone.__dict__.update(module.__dict__)
            for name, value in module.__dict__.items():  # a cache the forward fills stays the user's
                if type(value) in _CONTAINERS:
                    clone.__dict__[name] = copy.copy(value)
            clone._buffers = {n: None if b is None else buffer_fn(b) for n, b in module._buffers.items()}
            if param_fn is not None:
                clone._parameters = {n: None if p is None else param_fn(p) for n, p in module._parameters.items()}
            clone._modules = {n: None if c is None else twin(c) for n, c in module._modules.items()}
        return twins[id(module)]

    def referenced(value):
        """A module held as a plain attribute (a tied head's ``self._embedding``, not a submodule),
        in a list or dict, or by a plain object (torchtune's ``TiedLinear``) is read as its twin:
        its parameters are the twin's (cast under mixed precision). So is a module a function held
        as an attribute closes over (x-transformers' ``lambda t: t @ self.token_emb.emb.weight.t()``)
        or takes as a default (``lambda x, block=block: block(x)``): the function is rebound to the twin."""
        if isinstance(value, nn.Module):
            return twin(value)
        if type(value) in (list, tuple):  # modules, or functions reading them (``[lambda x, b=b: b(x), ...]``)
            items = [referenced(v) for v in value]
            return type(value)(items) if any(a is not b for a, b in zip(items, value, strict=True)) else value
        if type(value) in (dict, collections.OrderedDict):
            items = {k: referenced(v) for k, v in value.items()}
            return type(value)(items) if any(items[k] is not v for k, v in value.items()) else value
        if isinstance(value, types.FunctionType) and (any(
                isinstance(_cell_value(c), nn.Module) for c in value.__closure__ or ()) or any(
                isinstance(d, nn.Module) for d in value.__defaults__ or ())):  # a lambda reading a module
            cells = tuple(types.CellType(twin(v)) if isinstance(v := _cell_value(c), nn.Module) else c
                          for c in value.__closure__) if value.__closure__ else None
            defaults = tuple(twin(d) if isinstance(d, nn.Module) else d
                             for d in value.__defaults__) if value.__defaults__ else None
            rebound = types.FunctionType(value.__code__, value.__globals__, value.__name__, defaults, cells)
            rebound.__kwdefaults__ = value.__kwdefaults__
            return rebound
        held = getattr(value, "__dict__", None)
        if type(held) is dict and not isinstance(value, (type, torch.Tensor)) and any(
                isinstance(v, nn.Module) for v in held.values()):  # a plain object holding a module (TiedLinear)
            copied = copy.copy(value)
            copied.__dict__.update((k, twin(v)) for k, v in held.items() if isinstance(v, nn.Module))
            return copied
        return value

    root = twin(model)
    for clone in list(twins.values()):
        for name, value in list(clone.__dict__.items()):
            if name not in _MODULE_STATE and not name.startswith(("_forward", "_backward")):
                clone.__dict__[name] = referenced(value)
    return root


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def find_blocks(model: nn.Module) -> tuple[str, ...]:
    """The repeated blocks of ``model``: FSDP units, one all-gather each, in module order.

    Model code keeps its layers in a stack: a ``ModuleList`` or ``Sequential`` (``layers.0``,
    ``model.layers.3``), or a ``ModuleDict`` of like layers keyed by number (torchtitan's
    ``layers["0"]``). A stack may sit at any depth and inside other containers: nanoGPT holds
    ``h`` (its layers) inside ``transformer = ModuleDict(wte=..., h=..., ln_f=...)``, a
    ``ModuleDict`` of unlike modules, which is a namespace to look inside, not a stack. Each
    stack found is one set of blocks (an encoder's and a decoder's both count).

    In a stack, the blocks are its layers: the children with submodules holding parameters. A
    leaf beside them (the embedding or the head of a ``Sequential`` model, a final norm) stays
    in the root unit with everything else outside the stacks. A stack of leaves of one class (an
    MLP's linears) has each as a block. A layer that is itself a ``ModuleList`` (vit-pytorch's
    ``[attention, feed-forward]`` pairs) is not one call: its layers are the blocks.

    A module registered under two names (a stack kept as ``self.layers`` and ``self.blocks``) is
    one block, named as ``named_parameters()`` first names its parameters: FSDP manages each
    parameter in one unit, so the units proven are the units ``fully_shard`` gets.
    """
    blocks: list[str] = []
    seen: set[int] = set()

    def visit(prefix: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if _is_stack(module):
            for name in _stack_blocks(module):
                child = module.get_submodule(name)
                if isinstance(child, (nn.ModuleList, nn.ModuleDict)):  # not one call: its layers are the units
                    visit(f"{prefix}{name}.", child)
                elif id(child) not in seen:
                    seen.add(id(child))
                    blocks.append(prefix + name)
            return
        for name, child in module.named_children():
            visit(f"{prefix}{name}.", child)

    visit("", model)
    return _without_shared_parameters(model, blocks)


def _without_shared_parameters(model: nn.Module, blocks: list[str]) -> tuple[str, ...]:
    """``blocks`` less those holding a parameter another block holds too (a submodule shared by two
    layers, a norm weight tied across depth): FSDP manages each parameter in one unit, so such
    blocks stay in the root unit, and the units proven are the units ``fully_shard`` gets."""
    holders: dict[int, set[str]] = {}
    for block in blocks:
        for param in model.get_submodule(block).parameters():
            holders.setdefault(id(param), set()).add(block)
    shared = {b for names in holders.values() if len(names) > 1 for b in names}
    return tuple(b for b in blocks if b not in shared)


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _is_stack(module: nn.Module) -> bool:
    """A ``ModuleList``/``Sequential``, or a ``ModuleDict`` whose children holding parameters
    are all of one class (a namespace of unlike modules is not a stack)."""
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return True
    if isinstance(module, nn.ModuleDict):
        classes = {type(c) for c in module.children() if _holds_parameters(c)}
        return len(classes) == 1
    return False


def _stack_blocks(stack: nn.Module) -> list[str]:
    """The names of ``stack``'s children that are blocks (see :func:`find_blocks`): its layers
    (children with submodules holding parameters), or, in a stack of leaves of one class (linears
    of an MLP stack), every leaf. A ``Sequential`` of unlike leaves (a patch embedding's norm,
    linear, norm) is no stack of layers: its parameters stay with the root."""
    holding = [(name, child) for name, child in stack.named_children() if _holds_parameters(child)]
    layers = [name for name, child in holding if any(_holds_parameters(c) for c in child.children())]
    if layers:
        return layers
    return [name for name, _ in holding] if len({type(child) for _, child in holding}) == 1 else []


def _check_functions(model, args, kwargs, traced_calls, on_values: bool) -> tuple[CheckedFunction, ...]:
    """The custom autograd.Functions export met while tracing, each checked (see
    passes.functions) on the values it receives: the model runs once more, eagerly,
    on a twin whose buffers are copies and with the random state restored after, so
    the user's model and random streams are untouched. A model that does not run so
    has its Functions checked on random values of the traced shapes (after a failed
    export, on the calls traced before it failed)."""
    if not traced_calls:
        return ()
    if not on_values:  # on meta or in another dtype: random values of the traced shapes
        return check_functions(traced_calls, on_meta=True)
    calls = []
    twin = _twin(model, lambda b: b.clone())
    try:
        with recording_calls(calls, clone=True), torch.no_grad(), torch.random.fork_rng(devices=[]):
            twin(*args, **kwargs)
    except Exception:  # the model does not run eagerly (a failed export may say why)
        return check_functions(traced_calls, on_meta=True)
    return check_functions(calls, on_meta=False, traced=traced_calls)


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {alias: tied[0] for tied in names.values() for alias in tied[1:]}


def _read_tied_parameters_by_one_name(graph: fx.Graph, aliases: dict[str, str]) -> None:
    """Export reads a tied tensor under any of its names: read it under the canonical one."""
    reads: dict[str, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        fqn = aliases.get(node.target, node.target)
        if fqn in reads:
            node.replace_all_uses_with(reads[fqn])
            graph.erase_node(node)
        else:
            node.target = fqn
            reads[fqn] = node


def _path_name(path, arg_names: tuple[str, ...]) -> str:
    """The forward's argument name (``'tokens'``, ``'mask'``) and the path inside it."""
    head, first, *rest = path
    if head.idx == 0:
        index = first.idx
        name = arg_names[index] if index < len(arg_names) else f"args[{index}]"
    else:
        name = first.key
    return repr(name) + "".join(str(key) for key in rest)


def _first_lines(text: str, n: int = 6) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:n]) + ("\n..." if len(lines) > n else "")


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (same node names, shared attributes)."""
    graph = fx.Graph()
    output, old_output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(output).meta = copy.copy(old_output.meta)
    graph._codegen = gm.graph._codegen  # the calling convention, shared (it is never written)
    copied = graph_module(gm, graph, type(gm).__name__)
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(gm, attr):
            setattr(copied, attr, getattr(gm, attr))
    return copied


def graph_module(root: nn.Module | dict, graph: fx.Graph, class_name: str) -> fx.GraphModule:
    """A GraphModule whose Python code is written when first read or called, not when built.

    Planning reads only graphs: the captured module's code is never run (the passes rewrite
    its graph in place and emission builds modules of its own), and a copy kept for the proof
    is written when the proof first calls it. Writing a graph's code costs a few milliseconds
    per block, as much as planning the block.
    """
    return _LazyGraphModule(root, graph, class_name=class_name)
