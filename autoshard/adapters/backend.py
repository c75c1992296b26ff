"""``torch.compile(model, backend=autoshard.backend(mesh))``: shard what dynamo captures.

Dynamo hands a backend one FX graph per region between graph breaks, with the
model's parameters and buffers as graph inputs (the tensors themselves, and a
map from their flat names to the original FQNs). For each graph the backend:

1. rebuilds a module that holds those tensors at their original FQNs and whose
   forward replays the graph (:class:`_GraphAsModule`); the replay keeps each
   node's ``nn_module_stack``, so blocks are found as in the eager path;
2. runs the eager pipeline on it (:func:`autoshard.autoshard`): the same
   capture, plan, rewrite, FSDP2 units and checks, hence the same plan;
3. compiles each FSDP block of the sharded module (:mod:`autoshard.adapters.compiled_blocks`) with ``compiler``
   (``"inductor"`` or ``"aot_eager"``, any dynamo backend name) while FSDP2's
   hooks around the blocks stay eager, as they must (the root's own code,
   embedding and head, runs eagerly too);
4. returns a function that runs the sharded module on the graph's user inputs.

The model's parameters (:mod:`autoshard.adapters.handover`)
--------------------------------------------------
Dynamo keeps the model's parameter objects referenced (weak references and
use counts that ``torch.utils.swap_tensors`` refuses) and its guards check
their type and shape on every call, so they cannot turn into the sharded
DTensors in place without a recompile that would then trace the user's code
on transposed shards. The contract instead:

* From the first call on, the trained tensors are the sharded parameters:
  ``backend.parameters()``, ``backend.state_dict()`` (original FQNs and
  layout, as ``autoshard``'s), ``backend.plan``.
* The model's own parameters keep their metadata, so guards hold
  and nothing recompiles, but their storage is released: each rank holds only
  its shards. Reading them (running the uncompiled model) is an error.
* What reads the model's parameters is handed over explicitly, never through
  process-wide hooks: ``backend.attach(optimizer)`` for an optimizer built
  from ``model.parameters()`` (before or after the first call: on each
  ``step()`` it trains the shards instead; one that already holds state for
  a released parameter raises a ``RuntimeError`` naming it), and
  ``backend.attach(model)`` for ``model.state_dict()`` and
  ``model.load_state_dict()``. An optimizer built from
  ``backend.parameters()`` after the first call needs neither.
* An optimizer built from ``model.parameters()`` and not attached raises a
  ``RuntimeError`` naming ``backend.attach`` at its first ``step()``, before
  it changes anything: a released parameter's gradient is a marker whose use
  raises (:class:`autoshard.adapters.handover.ReleasedGradient`). It is not repointed
  to the shards behind the user's back, as finding it would take a hook on
  every optimizer of the process or a scan of every live object.

Each graph between graph breaks gets its own plan and FSDP root. A graph
dynamo captures again with the same code over the same parameters (grad mode
changed: an evaluation under ``torch.no_grad()``) runs the same sharded
module. A different graph over sharded parameters (read on both sides of a
graph break, new input shapes, another code path) is refused with a clear
error: the full weights it would be planned from are gone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh

from autoshard.adapters.compiled_blocks import compile_blocks
from autoshard.adapters.handover import Handover, keep_gradients_released, release
from autoshard.adapters.unit_casts import cast_as_fsdp_units, refusal_for_casts
from autoshard.core.options import Options
from autoshard.driver.entry_points import shard_model
from autoshard.passes.capture import CaptureError, find_blocks
from autoshard.plans.plan import Plan
from autoshard.runtime.activation_checkpointing import MODES

_DYNAMO_SELF = "L['self']"


@dataclasses.dataclass(frozen=True)
class GraphInputs:
    """What each placeholder of a dynamo graph is: a user input, or a model tensor by FQN."""

    kinds: tuple[str, ...]  # "input", "parameter" or "buffer", per placeholder
    fqns: tuple[str, ...]  # original FQN ("" for user inputs)

    @property
    def user_positions(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k == "input")


def read_graph_inputs(gm: fx.GraphModule, example_inputs) -> GraphInputs:
    """Match dynamo's placeholders to the original FQNs of the tensors they carry.

    Dynamo names a lifted parameter ``L_self_modules_layers_modules_0_..._parameters_weight_``
    and records ``dynamo_flat_name_to_original_fqn``; the placeholder ends with the
    FQN spelled in that scheme.
    """
    fqns = set((gm.meta.get("dynamo_flat_name_to_original_fqn") or {}).values())
    spelled = {}
    for fqn in fqns:
        *path, name = fqn.split(".")
        stem = "".join(f"modules_{p}_" for p in path)
        spelled[f"_{stem}parameters_{name}_"] = ("parameter", fqn)
        spelled[f"_{stem}buffers_{name}_"] = ("buffer", fqn)
    kinds, names = [], []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs, strict=True):
        match = [v for k, v in spelled.items() if node.target.endswith(k)]
        if match and isinstance(value, torch.Tensor):
            kind, fqn = max(match, key=lambda kv: len(kv[1]))
            kinds.append("parameter" if isinstance(value, nn.Parameter) else kind)
            names.append(fqn)
        else:
            kinds.append("input")
            names.append("")
    return GraphInputs(tuple(kinds), tuple(names))


class _GraphAsModule(nn.Module):
    """A dynamo graph as a module: its model tensors registered at their original FQNs.

    Modules along each FQN are plain ``nn.Module``s, except that a module
    whose children are numbered (``layers.0``, ``layers.1``) is a
    ``ModuleDict``, so the repeated blocks are found as in the user's model.
    The forward replays the graph node by node with node metadata preserved,
    so the captured ATen graph carries the user's ``nn_module_stack``.
    """

    # its forward replays the dynamo graph, so hooks on its blocks never run: capture it as it is
    replays_graph = True

    def __init__(self, graph: fx.GraphModule, inputs: GraphInputs, example_inputs):
        super().__init__()
        object.__setattr__(self, "_graph", graph)  # not a submodule: its tensors are ours
        self._inputs = inputs
        numbered = _numbered_parents(f for f in inputs.fqns if f)
        for kind, fqn, value in zip(inputs.kinds, inputs.fqns, example_inputs, strict=True):
            if kind == "input":
                continue
            owner, name = _make_owner(self, fqn, numbered)
            if kind == "parameter":
                owner._parameters[name] = value
            else:
                owner.register_buffer(name, value)

    def forward(self, *user_inputs):
        given = iter(user_inputs)
        args = [
            next(given) if kind == "input" else self._tensor(kind, fqn)
            for kind, fqn in zip(self._inputs.kinds, self._inputs.fqns, strict=True)
        ]
        with fx_traceback.preserve_node_meta():
            return fx.Interpreter(self._graph).run(*args)

    def _tensor(self, kind: str, fqn: str) -> torch.Tensor:
        return self.get_parameter(fqn) if kind == "parameter" else self.get_buffer(fqn)


def _numbered_parents(fqns) -> set[str]:
    parents = set()
    for fqn in fqns:
        parts = fqn.split(".")
        for i, part in enumerate(parts[:-1]):
            if part.isdigit():
                parents.add(".".join(parts[:i]))
    return parents


def _make_owner(root: nn.Module, fqn: str, numbered: set[str]) -> tuple[nn.Module, str]:
    *path, name = fqn.split(".")
    owner = root
    for i, part in enumerate(path):
        if part not in owner._modules:
            here = ".".join(path[: i + 1])
            owner._modules[part] = nn.ModuleDict() if here in numbered else nn.Module()
        owner = owner._modules[part]
    return owner, name


def _user_fqn_paths(graph: fx.GraphModule) -> None:
    """Rewrite dynamo's module paths (``L['self'].layers.0``) to FQNs (``layers.0``)."""
    for node in graph.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        node.meta["nn_module_stack"] = {
            key: (_fqn_of_dynamo_path(path), cls) for key, (path, cls) in stack.items()
        }


def _fqn_of_dynamo_path(path: str) -> str:
    if path.startswith(_DYNAMO_SELF):
        path = path[len(_DYNAMO_SELF):].lstrip(".")
    return path.replace("[", ".").replace("]", "").replace("'", "")


class _ShardedGraph:
    """What dynamo calls in place of one graph: the sharded module on the graph's user inputs.

    The model's tensors still arrive as arguments; they are checked to be the
    ones this graph was sharded from. Dynamo guards a parameter's metadata, not
    its identity, and matches a backend by ``id``: a second model of the same
    class, compiled after the first one's backend was freed, can reach this
    graph and would silently run the first model's shards.
    """

    def __init__(self, module: fx.GraphModule, inputs: GraphInputs, example_inputs):
        self.module = module
        self.inputs = inputs
        # placeholder position -> the model's tensor it carried when sharded
        self._model_tensors = {i: example_inputs[i] for i, kind in enumerate(inputs.kinds) if kind != "input"}
        self._to_release = {
            inputs.fqns[i]: example_inputs[i] for i, kind in enumerate(inputs.kinds) if kind == "parameter"
        }
        self._released_gradients = []  # (model parameter, its ReleasedGradient), from the first call on

    def __call__(self, *args):
        for position, tensor in self._model_tensors.items():
            if args[position] is not tensor:
                raise RuntimeError(
                    f"autoshard backend: this compiled graph was sharded from another model's "
                    f"'{self.inputs.fqns[position]}'; dynamo reused it for a model of the same class. Call "
                    f"torch._dynamo.reset() before compiling another model of that class"
                )
        if self._to_release:  # after dynamo is done with the values (guards, fake tensors)
            self._released_gradients = release(self._to_release)
            self._to_release = {}
        outputs = self.module(*(args[i] for i in self.inputs.user_positions))
        self._keep_gradients_released_on_backward(outputs)
        return outputs

    def _keep_gradients_released_on_backward(self, outputs) -> None:
        """At the backward through ``outputs``, mark the released parameters' gradients again.

        A ``zero_grad()`` between the forward and the step (of an optimizer
        not attached) sets them to None, and the step would then skip them
        silently; marked again at the backward, its step raises.
        """
        needing_grad = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if needing_grad and self._released_gradients:
            marked = self._released_gradients
            torch.autograd.graph.register_multi_grad_hook(
                needing_grad, lambda grad: keep_gradients_released(marked), mode="any"
            )


class AutoshardBackend:
    """A dynamo backend that shards each captured graph over ``mesh``; see the module doc.

    ``compiler`` compiles each FSDP block of the sharded graph (a dynamo
    backend name: ``"inductor"``, ``"aot_eager"``, ``"eager"``).
    ``options`` (an :class:`~autoshard.core.options.Options`) and ``keywords`` are
    :func:`autoshard.autoshard`'s (``sequence_parallel``, ``on_indivisible``, ``reshard_after_forward``...).
    """

    def __init__(self, mesh: DeviceMesh | None, compiler: str = "inductor", options: Options | None = None,
                 **keywords):
        if "example_inputs" in keywords or "plan" in keywords:
            raise ValueError("autoshard.backend: example inputs come from dynamo; `plan` is made per graph")
        chosen = Options.of(options, caller="autoshard.backend", **keywords)
        if chosen.sharding.activation_checkpointing not in (None, *MODES):
            raise ValueError("autoshard.backend: activation_checkpointing must be None, 'full' or 'selective', got "
                             f"{chosen.sharding.activation_checkpointing!r}")
        if mesh is not None and "pp" in (mesh.mesh_dim_names or ()):
            raise NotImplementedError(
                "autoshard.backend: pipeline stages (a 'pp' axis) cut the whole model into stages a schedule "
                "runs, and dynamo hands the backend one graph per break; shard the model with "
                "autoshard.autoshard(model, mesh, example_inputs=..., loss_fn=...) instead"
            )
        self.mesh = mesh
        self.compiler = compiler
        self.options = chosen
        self.sharded: list[fx.GraphModule] = []
        self.handover = Handover()

    def __call__(self, gm: fx.GraphModule, example_inputs) -> Callable:
        mesh = self.mesh if self.mesh is not None else default_mesh()
        inputs = read_graph_inputs(gm, example_inputs)
        code = gm.code
        again = self.handover.sharded_before(inputs, example_inputs, code)
        if again is not None:  # the same graph captured again (e.g. under torch.no_grad())
            return _ShardedGraph(again, inputs, example_inputs)
        _user_fqn_paths(gm)
        as_module = _GraphAsModule(gm, inputs, example_inputs)
        policy = self.options.precision.mp_policy
        fixed = ()
        if policy is not None and policy.param_dtype is not None:
            fixed = cast_as_fsdp_units(gm, inputs.kinds, find_blocks(as_module), policy)
        user_inputs = tuple(example_inputs[i] for i in inputs.user_positions)
        try:
            sharded = shard_model(as_module, mesh, user_inputs, None, None, self.options)
        except CaptureError as err:
            if not fixed:
                raise
            raise refusal_for_casts(fixed, policy.param_dtype) from err
        compile_blocks(sharded, self.compiler, self.options.sharding.activation_checkpointing)
        self.sharded.append(sharded)
        self.handover.take(sharded, dict(as_module.named_parameters(remove_duplicate=False)), code)
        return _ShardedGraph(sharded, inputs, example_inputs)

    @property
    def plan(self) -> Plan:
        """The plans of every sharded graph, as one plan (each parameter is in exactly one)."""
        if not self.sharded:
            raise RuntimeError("autoshard backend: nothing is sharded before the compiled model's first call")
        plans = [s.autoshard_plan for s in self.sharded]
        params = {fqn: entry for p in plans for fqn, entry in p.params.items()}
        units = tuple(u for p in plans for u in p.units)
        activations = tuple(a for p in plans for a in p.activations)
        activation_units = tuple(p.unit_of_activation(i) for p in plans for i in range(len(p.activations)))
        return dataclasses.replace(
            plans[0], params=params, units=units, activations=activations, activation_units=activation_units,
            functions=tuple(f for p in plans for f in p.functions), breaks=tuple(b for p in plans for b in p.breaks),
        )

    def attach(self, target):
        """Hand ``target`` over to the shards and return it.

        Args:
            target: an optimizer built from ``model.parameters()``: on every
                ``step()`` it steps the sharded parameters instead of the
                model's released ones (attach it before or after the first
                call; one not attached raises at its first ``step()``, naming
                this method); or the compiled model itself: ``model.state_dict()``
                then saves the shards (DTensors in the original layout, under
                the model's keys) and ``model.load_state_dict()`` loads into
                them.

        Example::

            backend = autoshard.backend(mesh)
            compiled = torch.compile(model, backend=backend)
            optimizer = backend.attach(torch.optim.AdamW(model.parameters()))
            backend.attach(model)
        """
        return self.handover.attach(target)

    def parameters(self) -> Iterator[nn.Parameter]:
        for module in self.sharded:
            yield from module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for module in self.sharded:
            yield from module.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in its original FQNs and layout, values DTensors."""
        merged = {}
        for module in self.sharded:
            merged.update(module.state_dict())
        return merged

    def load_state_dict(self, state_dict, strict: bool = True) -> None:
        """Load a state dict of the model (original FQNs and layout; full tensors or DTensors).

        Buffers are optional: the backend sees every buffer the graph reads but
        not which ones the model keeps out of its state dict.
        """
        params = {fqn for module in self.sharded for fqn, _ in module.named_parameters(remove_duplicate=False)}
        known = {fqn for module in self.sharded for fqn in module.state_dict(keep_vars=True)}
        missing, unexpected = sorted(params - state_dict.keys()), sorted(state_dict.keys() - known)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"autoshard backend: state dict does not match the sharded model: missing {missing or 'none'}, "
                f"unexpected {unexpected or 'none'}"
            )
        for module in self.sharded:
            keys = module.state_dict(keep_vars=True).keys()
            module.load_state_dict({k: v for k, v in state_dict.items() if k in keys}, strict=False)


def default_mesh() -> DeviceMesh:
    """All ranks as ``dp x tp`` with tp the ranks of one host (``LOCAL_WORLD_SIZE``, as torchrun sets).

    Tensor parallelism needs the fast links inside a host; FSDP's traffic
    crosses hosts. The mesh made current by ``with mesh:`` wins over this.
    """
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import _mesh_resources, init_device_mesh

    current = _mesh_resources.get_current_mesh() if _mesh_resources.mesh_stack else None
    if current is not None:
        return current
    if not dist.is_initialized():
        raise ValueError("autoshard backend: no mesh given and no process group initialized")
    world = dist.get_world_size()
    tp = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % tp:
        raise ValueError(f"autoshard backend: LOCAL_WORLD_SIZE={tp} does not divide the world size {world}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def backend(mesh: DeviceMesh | None = None, *, compiler: str = "inductor", options: Options | None = None,
            **keywords) -> AutoshardBackend:
    """A backend for ``torch.compile(model, backend=autoshard.backend(mesh))``.

    Args:
        mesh: the ``dp x tp`` mesh; defaults to :func:`default_mesh`.

    Keyword Args:
        compiler: the dynamo backend each sharded FSDP block is compiled with
            (``"inductor"``, ``"aot_eager"``, ``"eager"``).
        options: :func:`autoshard.autoshard`'s :class:`~autoshard.core.options.Options`, and its
            keywords applied over it (not ``example_inputs``, which come from dynamo, nor ``plan``).

    Returns:
        The :class:`AutoshardBackend`: after the compiled model's first call it
        holds ``plan``, ``parameters()`` and ``state_dict()``;
        :meth:`~AutoshardBackend.attach` hands an optimizer or the model over.

    Example::

        backend = autoshard.backend(mesh)
        compiled = torch.compile(model, backend=backend)
        optimizer = backend.attach(torch.optim.AdamW(model.parameters()))
    """
    return AutoshardBackend(mesh, compiler, options, **keywords)


_MADE = "_autoshard_backend"  # where the registered name keeps the backend it made, in its options


def _registered(gm: fx.GraphModule, example_inputs, options: dict | None = None, **unused):
    """``torch.compile(model, backend="autoshard", options={"mesh": mesh, "compiler": "aot_eager",
    "attach": [optimizer, model]})``.

    ``attach``: what :meth:`AutoshardBackend.attach` hands over. Dynamo passes
    the same ``options`` dict on every capture of the compiled model, so the
    backend made at the first capture is kept in it: a graph captured again
    (an evaluation under ``torch.no_grad()``) finds the shards it made.
    """
    options = options if options is not None else {}
    made = options.get(_MADE)
    if made is None:
        settings = {k: v for k, v in options.items() if k != "attach"}
        made = AutoshardBackend(settings.pop("mesh", None), settings.pop("compiler", "inductor"), **settings)
        attach = options.get("attach", ())
        for target in attach if isinstance(attach, (list, tuple)) else (attach,):
            made.attach(target)
        options[_MADE] = made
    return made(gm, example_inputs)


def register_backend_name() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "autoshard" not in _BACKENDS:
        register_backend(name="autoshard")(_registered)
