"""Checkpoints in the original model's layout, on any mesh.

A sharded module stores colwise weights transposed and fused projections
with their columns permuted per tp size; its ``state_dict()`` already hides
that (``autoshard/runtime/state_dict.py``). This module does the same for the rest of
a training checkpoint, so a checkpoint names and shapes every tensor as the
single-device model does and loads on any mesh, or on no mesh at all:

* :func:`full_state_dict`: the whole model as plain tensors, what
  ``model.state_dict()`` of the single-device model would be (for
  ``torch.save``, ``save_pretrained`` or safetensors).
* :func:`get_state_dict` / :func:`set_state_dict`: model and optimizer state
  dicts for ``torch.distributed.checkpoint`` (DCP). The optimizer's
  per-parameter tensors (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``)
  are converted to the original layout exactly like the weights they belong to.
* :func:`save_checkpoint` / :func:`load_latest`: one DCP checkpoint per step
  directory, made visible by a commit marker written last, atomically. A
  directory without a valid marker (a rank died mid-save) is never loaded.

Every function here that reads sharded tensors is a collective: call it on
every rank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections import OrderedDict
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.tensor import DTensor

from autoshard.plans.plan import Plan
from autoshard.runtime.state_dict import StoredLayout

COMMIT_MARKER = "commit.json"
DCP_METADATA = ".metadata"
MARKER_FORMAT = "autoshard-checkpoint"
MARKER_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


def full_state_dict(sharded: nn.Module) -> OrderedDict:
    """The sharded module's state as full, plain CPU tensors in the original layout.

    A collective (each tensor is all-gathered): every rank must call it, and
    every rank gets the whole dict, so each holds one full copy of the model.
    Keys, their order, ``_metadata`` and tied names (views of one storage)
    are those of the single-device model's ``state_dict()``, so
    ``torch.save(full_state_dict(sharded), f)`` writes the bytes
    ``torch.save(model.state_dict(), f)`` would. For models too large for one
    rank, save with DCP (:func:`save_checkpoint`) instead.

    Args:
        sharded: the module :func:`autoshard.autoshard` returned (a pipeline's stages are gathered
            over its pp axis too, with pickled CPU tensors: every rank gets every stage's entries).
    """
    if type(sharded).__name__ == "Pipeline":
        return _pipeline_full_state_dict(sharded)
    state = sharded.state_dict()
    full = OrderedDict()
    gathered: dict[tuple, torch.Tensor] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):  # a module's extra state, kept as it is
            full[key] = value
            continue
        identity = _storage_identity(value)
        if identity in gathered:  # a tied name: a new view of the same storage, as state_dict() gives
            full[key] = gathered[identity].detach()
            continue
        tensor = value.full_tensor() if isinstance(value, DTensor) else value.detach()
        full[key] = gathered[identity] = tensor.to("cpu", copy=True).contiguous()
    if hasattr(state, "_metadata"):
        full._metadata = state._metadata
    return full


def _pipeline_full_state_dict(pipeline) -> OrderedDict:
    mine = full_state_dict(pipeline.module)
    from autoshard.core.mesh import PP

    group = pipeline.axes.mesh.get_group(PP)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, dict(mine), group=group)
    merged = {k: v for part in every for k, v in part.items()}
    full = OrderedDict((k, merged[k]) for k in pipeline.state_dict_keys if k in merged)
    if hasattr(mine, "_metadata"):
        full._metadata = mine._metadata
    return full


def _storage_identity(value: torch.Tensor) -> tuple:
    """Equal for the names of one tied parameter (each ``state_dict()`` entry is a fresh view)."""
    local = value.to_local() if isinstance(value, DTensor) else value
    spec = (tuple(value.placements), value.device_mesh) if isinstance(value, DTensor) else ()
    return (
        local.untyped_storage().data_ptr(),
        local.storage_offset(),
        tuple(value.shape),
        tuple(value.stride()),
        spec,
    )


def get_state_dict(sharded: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, dict]:
    """``(model_state_dict, optimizer_state_dict)`` in the original layout, for DCP.

    Calls ``torch.distributed.checkpoint.state_dict.get_state_dict`` and
    converts each optimizer tensor shaped like its stored parameter to the
    original layout, so the pair saves and loads on any mesh. Without an
    optimizer the second dict is empty.
    """
    sharded = _module_of(sharded)
    optimizers = (optimizer,) if optimizer is not None else ()
    model_sd, optim_sd = dcp_state_dict.get_state_dict(sharded, optimizers)
    layout, params = _layout(sharded), dict(sharded.named_parameters())
    state = optim_sd.get("state", {})
    for fqn, entries in state.items():
        if layout.is_changed(fqn):  # a new dict: ``entries`` is the optimizer's own state of this parameter
            state[fqn] = {
                name: layout.to_original(fqn, value) if _is_per_element(value, params[fqn].shape) else value
                for name, value in entries.items()
            }
    return model_sd, optim_sd


def set_state_dict(
    sharded: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    model_state_dict: Mapping,
    optim_state_dict: Mapping | None = None,
) -> None:
    """Load what :func:`get_state_dict` returned (possibly saved on another mesh).

    Optimizer tensors shaped like their original parameter are brought to the
    stored layout of this module's mesh before
    ``torch.distributed.checkpoint.state_dict.set_state_dict`` loads them.
    """
    sharded = _module_of(sharded)
    if optimizer is None:
        dcp_state_dict.set_model_state_dict(sharded, dict(model_state_dict))
        return
    if optim_state_dict is None:
        raise ValueError("autoshard: set_state_dict got an optimizer but no `optim_state_dict`")
    layout, params = _layout(sharded), dict(sharded.named_parameters())
    state = {}
    for fqn, entries in optim_state_dict.get("state", {}).items():
        entries = dict(entries)
        if layout.is_changed(fqn):
            original_shape = layout.original_shapes[fqn]
            for name, value in entries.items():
                if not _is_per_element(value, original_shape):
                    continue
                stored = layout.to_stored(fqn, value, params[fqn])
                if isinstance(stored, str) or tuple(stored.shape) != tuple(params[fqn].shape):
                    raise ValueError(f"autoshard: optimizer state '{fqn}.{name}' has shape {list(value.shape)}; "
                                     f"expected the parameter's original shape {list(original_shape)}")
                entries[name] = _like(stored, params[fqn])
        state[fqn] = entries
    optim_state_dict = {**optim_state_dict, "state": state}
    dcp_state_dict.set_state_dict(
        sharded, (optimizer,), model_state_dict=dict(model_state_dict), optim_state_dict=optim_state_dict
    )


def _module_of(sharded) -> nn.Module:
    """The module holding a pipeline's stages on this rank (:attr:`~autoshard.runtime.pipeline_stages.Pipeline.module`),
    or ``sharded`` itself: a pipeline checkpoints like a sharded module, each rank its own stages."""
    return getattr(sharded, "module", sharded) if type(sharded).__name__ == "Pipeline" else sharded


def _layout(module: nn.Module) -> StoredLayout:
    """The sharded module's layout; a plain module's is the original one (nothing to convert)."""
    plan = getattr(module, "autoshard_plan", None)
    if isinstance(plan, Plan):
        return StoredLayout.of(plan, int(plan.mesh.get("tp", 1)))
    return StoredLayout(transposed=frozenset(), permuted={}, original_shapes={})


def _is_per_element(value, shape) -> bool:
    """An optimizer tensor with one entry per parameter element (not Adam's scalar ``step``)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(shape)


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` with exactly ``param``'s placements, as the optimizer's step expects."""
    if isinstance(param, DTensor) and isinstance(value, DTensor) and tuple(value.placements) != tuple(
        param.placements
    ):
        return value.redistribute(param.device_mesh, param.placements)
    return value


# --- checkpoint directories -------------------------------------------------------------------


def step_directory(directory: str | os.PathLike, step: int) -> str:
    return os.path.join(os.fspath(directory), f"step_{step:08d}")


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    sharded: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> str:
    """Save model (and optimizer) state with DCP to ``directory/step_<step>``; return that path.

    Every rank writes its shards; once all are written (DCP's save returns on
    every rank only after rank 0 wrote ``.metadata``), rank 0 writes the
    commit marker, which lists every file with its size, by write-temp, fsync
    and ``os.replace``: the checkpoint becomes visible all at once or not at
    all. A step directory left by an earlier attempt is removed first.
    ``directory`` must be one filesystem every rank sees. ``process_group``
    is the ranks that hold ``sharded`` (default: every rank of the job); give
    it when the module's mesh covers only part of the job, as DCP's own.

    Args:
        directory: the checkpoint root, seen by every rank.
        step: the training step (``>= 0``), the step directory's name.
        sharded: the module :func:`autoshard.autoshard` returned.
        optimizer: its optimizer, saved with it (its state in the original layout).
        process_group: see above.
    """
    if step < 0:
        raise ValueError(f"autoshard: checkpoint step must be >= 0, got {step}")
    path = step_directory(directory, step)
    if _rank(process_group) == 0:
        _remove_marker_then_directory(path)
        os.makedirs(path)
    _barrier(process_group)
    model_sd, optim_sd = get_state_dict(sharded, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, no_dist=not _distributed(),
             process_group=process_group)
    if _rank(process_group) == 0:
        _write_marker(path, step)
    _barrier(process_group)
    return path


def load_checkpoint(path: str | os.PathLike, sharded: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, process_group: dist.ProcessGroup | None = None) -> int:
    """Load one committed checkpoint directory into ``sharded`` (and ``optimizer``); return its step.

    A directory without a valid commit marker raises a ``ValueError`` saying
    what is missing, before anything is read. ``process_group`` as for
    :func:`save_checkpoint`.
    """
    path = os.fspath(path)
    step = verify_checkpoint(path)
    model_sd, optim_sd = get_state_dict(sharded, optimizer)
    state = {"model": model_sd, "optim": optim_sd} if optimizer is not None else {"model": model_sd}
    dcp.load(state, checkpoint_id=path, no_dist=not _distributed(), process_group=process_group)
    set_state_dict(sharded, optimizer, model_state_dict=state["model"], optim_state_dict=state.get("optim"))
    return step


def load_latest(directory: str | os.PathLike, sharded: nn.Module,
                optimizer: torch.optim.Optimizer | None = None, *,
                process_group: dist.ProcessGroup | None = None) -> int | None:
    """Load the newest committed checkpoint under ``directory``; its step, or None if there is none.

    Step directories without a valid commit marker (torn by a failure during
    save) are skipped with a warning. Rank 0 chooses, so every rank loads the
    same checkpoint.

    Args:
        directory: the checkpoint root :func:`save_checkpoint` wrote to.
        sharded: the module to load into (any mesh: DCP reshards).
        optimizer: its optimizer, loaded too when given.
        process_group: the ranks that hold ``sharded``, as for :func:`save_checkpoint`.
    """
    choice = [latest_checkpoint(directory) if _rank(process_group) == 0 else None]
    if _distributed():
        dist.broadcast_object_list(choice, group=process_group, group_src=0)
    if choice[0] is None:
        return None
    return load_checkpoint(choice[0][1], sharded, optimizer, process_group=process_group)


def latest_checkpoint(directory: str | os.PathLike) -> tuple[int, str] | None:
    """``(step, path)`` of the newest committed checkpoint under ``directory``, or None.

    Reads only the filesystem (no process group needed); torn step
    directories are skipped with a warning naming what is wrong.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    steps = sorted(
        ((int(m.group(1)), os.path.join(directory, name)) for name in os.listdir(directory)
         if (m := _STEP_DIR.match(name))),
        reverse=True,
    )
    for step, path in steps:
        try:
            verify_checkpoint(path)
        except ValueError as err:
            warnings.warn(f"{err}; skipping it", stacklevel=2)
            continue
        return step, path
    return None


def verify_checkpoint(path: str | os.PathLike) -> int:
    """The step of a complete checkpoint directory; a ``ValueError`` naming what is torn otherwise."""
    path = os.fspath(path)
    marker_path = os.path.join(path, COMMIT_MARKER)
    if not os.path.isfile(marker_path):
        raise ValueError(f"autoshard: checkpoint '{path}' is incomplete: no commit marker {COMMIT_MARKER}")
    try:
        with open(marker_path) as f:
            marker = json.load(f)
        step, files = int(marker["step"]), dict(marker["files"])
        if marker.get("format") != MARKER_FORMAT:
            raise ValueError(f"format {marker.get('format')!r}")
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"autoshard: checkpoint '{path}' has an unreadable commit marker ({err})") from err
    if DCP_METADATA not in files:
        raise ValueError(f"autoshard: checkpoint '{path}': its commit marker lists no {DCP_METADATA}")
    for name, size in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ValueError(f"autoshard: checkpoint '{path}' is torn: file {name} is missing")
        if os.path.getsize(file) != size:
            raise ValueError(
                f"autoshard: checkpoint '{path}' is torn: file {name} has {os.path.getsize(file)} bytes, "
                f"the commit marker recorded {size}"
            )
    return step


def _write_marker(path: str, step: int) -> None:
    files = {
        name: os.path.getsize(os.path.join(path, name))
        for name in sorted(os.listdir(path))
        if os.path.isfile(os.path.join(path, name)) and name != COMMIT_MARKER and not name.endswith(".tmp")
    }
    if DCP_METADATA not in files:
        raise RuntimeError(f"autoshard: DCP save to '{path}' finished without writing {DCP_METADATA}")
    marker = {"format": MARKER_FORMAT, "version": MARKER_VERSION, "step": step, "files": files}
    temp = os.path.join(path, COMMIT_MARKER + ".tmp")
    with open(temp, "w") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, os.path.join(path, COMMIT_MARKER))
    _fsync_directory(path)


def _remove_marker_then_directory(path: str) -> None:
    """Uncommit first, so a crash while deleting never leaves a committed, partial directory."""
    marker = os.path.join(path, COMMIT_MARKER)
    if os.path.exists(marker):
        os.remove(marker)
        _fsync_directory(path)
    if os.path.exists(path):
        shutil.rmtree(path)


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if _distributed() else 0


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if _distributed():
        dist.barrier(group=group)
