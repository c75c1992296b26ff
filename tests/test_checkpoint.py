"""Checkpoints in the original layout: DCP across meshes, full state dicts, optimizer state, resume,
and a Hugging Face ``save_pretrained`` directory read straight into a sharded model.

One 4-process group runs the distributed checks; the killed-rank resume test
spawns its own two jobs (the crashed one and the restart); the torn-directory
tests run in this process without a process group.
"""

from __future__ import annotations

import datetime
import io
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, HuggingFaceStorageReader
from torch.distributed.device_mesh import init_device_mesh
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import autoshard
from autoshard.adapters import checkpoint
from autoshard.adapters.launch import RankFailed, spawn
from examples.models import Llama, LlamaConfig
from tests.distributed import distributed_tests, remove_shared, shared_directory
from tests.hf_cases import CASES, VOCAB, llama_with_cache
from tests.parity import dp_slice, full, lm_loss, mean_over_dp, rel_error

# A checkpoint holds the same numbers on every mesh; only the order of floating-point
# reductions differs (tp all-reduces split the matmul sums, FSDP averages gradients in
# another order), so the next loss agrees to float32 rounding, not bitwise.
LOSS_TOL = 1e-6
# After one more AdamW step from the same state the gradients differ by that rounding and
# Adam's m / (sqrt(v) + eps) passes it on to the step; eps=1e-6 (not 1e-8) keeps rounding
# noise on near-zero gradients from becoming full-size steps (see tests/parity.py).
STEP_TOL = 1e-5
# A checkpoint read into another layout gives the same weights; the forward differs from one
# device by the order of the tp sums.
LOGITS_TOL = 1e-5


def _llama(seed: int = 0) -> Llama:
    """Head counts that divide by 4, so tp=4 shards attention the same way tp=2 does."""
    torch.manual_seed(seed)
    return Llama(LlamaConfig(num_layers=2, num_heads=8, num_kv_heads=4))


def _batch(step: int, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (4, 16), generator=gen), torch.randint(0, vocab, (4, 16), generator=gen)


def _logits(output):
    return output.logits if hasattr(output, "logits") else output


def _loss(model, mesh, step: int, vocab: int = 256) -> torch.Tensor:
    """This rank's loss on its dp slice of batch ``step`` (the whole batch without a mesh)."""
    tokens, targets = _batch(step, vocab)
    if mesh is not None:
        tokens, targets = dp_slice(tokens, mesh), dp_slice(targets, mesh)
    return lm_loss(_logits(model(tokens)), targets)


def _mean_loss(model, mesh, step: int, vocab: int = 256) -> float:
    with torch.no_grad():
        loss = _loss(model, mesh, step, vocab)
    return (mean_over_dp(loss, mesh) if mesh is not None else loss).item()


def _shard(model, mesh, vocab: int = 256):
    return autoshard.autoshard(model, mesh, example_inputs=(dp_slice(_batch(0, vocab)[0], mesh),))


def _train(sharded, optimizer, mesh, steps, vocab: int = 256) -> list[float]:
    losses = []
    for step in steps:
        loss = _loss(sharded, mesh, step, vocab)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_dp(loss, mesh).item())
    return losses


def _relative_loss_error(got: float, want: float) -> float:
    return abs(got - want) / abs(want)


def _check_dcp_across_meshes(ctx, build, meshes, vocab):
    """Save ``sharded.state_dict()`` with DCP on 2x2; load it on other meshes and into
    the plain model: the next loss matches the 2x2 one and every tensor is bit-equal."""
    directory = shared_directory(ctx)
    sharded = _shard(build(0), ctx.mesh_2d, vocab)
    _train(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), ctx.mesh_2d, [0], vocab)
    saved = sharded.state_dict()
    dcp.save(saved, checkpoint_id=directory)
    expected = {key: full(value) for key, value in saved.items()}
    want = _mean_loss(sharded, ctx.mesh_2d, 1, vocab)

    stored = FileSystemReader(directory).read_metadata().state_dict_metadata
    assert set(stored) == set(expected), sorted(stored)
    for key, value in expected.items():  # original FQNs, original shapes
        assert tuple(stored[key].size) == tuple(value.shape), (key, stored[key].size, value.shape)

    for name in meshes:
        mesh = getattr(ctx, name)
        other = _shard(build(1), mesh, vocab)  # initialized differently: only the checkpoint can make it agree
        state = other.state_dict()
        dcp.load(state, checkpoint_id=directory)
        other.load_state_dict(state)
        for key, value in other.state_dict().items():
            assert torch.equal(full(value), expected[key]), (name, key)
        got = _mean_loss(other, mesh, 1, vocab)
        assert _relative_loss_error(got, want) <= LOSS_TOL, (name, got, want)

    plain = build(1)
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=directory, no_dist=True)  # one process, no collectives
    plain.load_state_dict(state)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, expected[key]), ("plain", key)
    got = _mean_loss(plain, None, 1, vocab)
    assert _relative_loss_error(got, want) <= LOSS_TOL, ("plain", got, want)
    remove_shared(ctx, directory)


def check_dcp_llama_2x2_to_1x4_4x1_and_plain(ctx):
    _check_dcp_across_meshes(ctx, _llama, ("mesh_tp", "mesh_dp"), vocab=256)


def _phi3(seed: int):
    """Fused q|k|v ([64|32|32], GQA) and gate|up: the stored columns are permuted per tp size."""
    torch.manual_seed(seed)
    return CASES["phi3"].build()


def _tied(seed: int):
    """Input embedding and LM head are one parameter."""
    torch.manual_seed(seed)
    return CASES["llama_tied"].build()


def check_dcp_fused_phi3_2x2_to_1x4_and_plain(ctx):
    _check_dcp_across_meshes(ctx, _phi3, ("mesh_tp",), vocab=VOCAB)


def _torch_save_bytes(state) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def check_full_state_dict_round_trip_is_byte_identical(ctx):
    """Plain state dict -> sharded.load_state_dict -> full_state_dict -> torch.save: the same bytes,
    for the Llama example (transposed weights, 2x2), the fused Phi-3 (columns permuted for tp=4)
    and a tied HF Llama (one storage under two names)."""
    for build, mesh, vocab in ((_llama, ctx.mesh_2d, 256), (_phi3, ctx.mesh_tp, VOCAB), (_tied, ctx.mesh_2d, VOCAB)):
        original = build(0).state_dict()
        original_bytes = _torch_save_bytes(original)
        sharded = _shard(build(1), mesh, vocab)
        sharded.load_state_dict(torch.load(io.BytesIO(original_bytes)))
        gathered = checkpoint.full_state_dict(sharded)
        assert list(gathered) == list(original)
        for key, value in original.items():
            assert torch.equal(gathered[key], value), key
        assert _torch_save_bytes(gathered) == original_bytes, type(sharded).__name__
    head, embedding = gathered["lm_head.weight"], gathered["model.embed_tokens.weight"]
    assert head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()  # saved once


def check_safetensors_round_trip_is_byte_identical(ctx):
    """HF ``save_pretrained`` safetensors -> sharded Phi-3 -> gathered -> safetensors: the same file."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    directory = shared_directory(ctx)
    if ctx.rank == 0:
        _phi3(0).save_pretrained(os.path.join(directory, "original"))
    dist.barrier()
    original_file = os.path.join(directory, "original", "model.safetensors")
    sharded = _shard(_phi3(1), ctx.mesh_2d)
    sharded.load_state_dict(load_file(original_file))
    gathered = checkpoint.full_state_dict(sharded)
    with safe_open(original_file, "pt") as f:
        metadata, keys = f.metadata(), set(f.keys())
    written = os.path.join(directory, f"rank{ctx.rank}.safetensors")
    save_file({key: gathered[key] for key in keys}, written, metadata=metadata)
    with open(original_file, "rb") as a, open(written, "rb") as b:
        assert a.read() == b.read()
    remove_shared(ctx, directory)


def _adamw(sharded):
    return torch.optim.AdamW(sharded.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def check_optimizer_state_moves_between_meshes(ctx):
    """AdamW 2 steps on 2x2, model + optimizer saved in the original layout; on 1x4 (through
    load_latest) and 4x1 (DCP load + set_state_dict) one more step gives the loss and
    parameters of continuing on 2x2."""
    directory = shared_directory(ctx)
    sharded = _shard(_llama(0), ctx.mesh_2d)
    optimizer = _adamw(sharded)
    _train(sharded, optimizer, ctx.mesh_2d, range(2))
    path = checkpoint.save_checkpoint(directory, 1, sharded, optimizer)
    assert checkpoint.verify_checkpoint(path) == 1
    _, optim_sd = checkpoint.get_state_dict(sharded, optimizer)
    saved_moments = {k: full(v["exp_avg"]) for k, v in optim_sd["state"].items()}
    stored = FileSystemReader(path).read_metadata().state_dict_metadata
    # wk is [32, 64] in the model and stored [64, 32] on every tp mesh: saved as the model has it
    assert tuple(stored["optim.state.layers.0.attention.wk.weight.exp_avg"].size) == (32, 64)
    assert tuple(stored["model.layers.0.attention.wk.weight"].size) == (32, 64)

    want_loss = _train(sharded, optimizer, ctx.mesh_2d, [2])[0]
    want_params = {k: full(v) for k, v in sharded.state_dict().items()}

    for name in ("mesh_tp", "mesh_dp"):
        mesh = getattr(ctx, name)
        other = _shard(_llama(1), mesh)
        other_optimizer = _adamw(other)
        if name == "mesh_tp":
            assert checkpoint.load_latest(os.path.join(directory, "nothing"), other, other_optimizer) is None
            assert checkpoint.load_latest(directory, other, other_optimizer) == 1
        else:
            model_sd, optim_sd = checkpoint.get_state_dict(other, other_optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=path)
            checkpoint.set_state_dict(other, other_optimizer, model_state_dict=state["model"],
                                      optim_state_dict=state["optim"])
        _, reloaded = checkpoint.get_state_dict(other, other_optimizer)
        for key, moment in saved_moments.items():
            assert torch.equal(full(reloaded["state"][key]["exp_avg"]), moment), (name, key)
        got_loss = _train(other, other_optimizer, mesh, [2])[0]
        assert _relative_loss_error(got_loss, want_loss) <= STEP_TOL, (name, got_loss, want_loss)
        for key, value in other.state_dict().items():
            assert rel_error(full(value), want_params[key]) <= STEP_TOL, (name, key)
    remove_shared(ctx, directory)


def fill_rotary_tables(model) -> None:
    """Recompute every rotary table of a Hugging Face model built on meta: ``inv_freq`` is a
    non-persistent buffer, in no checkpoint, so it has no value until computed from the config."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor) and inv_freq.is_meta:
            rope_init = ROPE_INIT_FUNCTIONS.get(module.rope_type, module.compute_default_rope_parameters)
            module.inv_freq, module.attention_scaling = rope_init(module.config, device="cpu")
            module.original_inv_freq = module.inv_freq.clone()


def check_save_pretrained_loads_into_a_meta_built_hf_model(ctx):
    """A ``save_pretrained`` checkpoint of a Hugging Face Llama, its config as saved (``use_cache``
    on), read straight into the sharded model of one built on meta (rotary tables recomputed):
    each rank reads its slices through DCP's ``HuggingFaceStorageReader``. Logits (``out.logits``
    and ``out[0]``) and the loss equal those of the model ``from_pretrained`` loads on one device."""
    directory = shared_directory(ctx)
    if ctx.rank == 0:
        torch.manual_seed(0)
        llama_with_cache().save_pretrained(directory)
    dist.barrier()
    mesh = ctx.mesh_2d
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        on_meta = transformers.AutoModelForCausalLM.from_config(config)
    fill_rotary_tables(on_meta)
    tokens, targets = _batch(0, VOCAB)
    local, local_targets = dp_slice(tokens, mesh), dp_slice(targets, mesh)
    sharded = autoshard.autoshard(on_meta, mesh, example_inputs=(local,))
    state = sharded.state_dict()
    dcp.load(state, storage_reader=HuggingFaceStorageReader(directory))
    sharded.load_state_dict(state)
    assert all(p.is_meta for p in on_meta.parameters()) and on_meta.config.use_cache  # the user's model

    reference = transformers.AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        out, want = sharded(local), reference(local)
        loss = mean_over_dp(lm_loss(out.logits, local_targets), mesh).item()
        want_loss = lm_loss(reference(tokens).logits, targets).item()
    assert isinstance(want.past_key_values, transformers.Cache) and out.past_key_values is None
    assert rel_error(out.logits, want.logits) <= LOGITS_TOL, rel_error(out.logits, want.logits)
    assert torch.equal(out[0], out.logits)
    assert _relative_loss_error(loss, want_loss) <= LOGITS_TOL, (loss, want_loss)
    with pytest.raises(ValueError, match="always runs with use_cache=False"):
        sharded(local, use_cache=True)
    with torch.no_grad():
        assert torch.equal(sharded(local, use_cache=False).logits, out.logits)
    remove_shared(ctx, directory)


CHECKS = [
    check_dcp_llama_2x2_to_1x4_4x1_and_plain,
    check_dcp_fused_phi3_2x2_to_1x4_and_plain,
    check_full_state_dict_round_trip_is_byte_identical,
    check_safetensors_round_trip_is_byte_identical,
    check_optimizer_state_moves_between_meshes,
    check_save_pretrained_loads_into_a_meta_built_hf_model,
]


outcomes, test_checkpoint = distributed_tests(CHECKS)


# --- resume after a killed rank ----------------------------------------------------------------

STEPS = 3
KILLED_RANK = 1
KILLED_WHILE_SAVING = 1  # the rank dies after writing its shard of this step's checkpoint


def _training_run(directory: str, losses_file: str | None = None) -> tuple[int | None, list[float]]:
    """Resume from the latest complete checkpoint (if any), train to STEPS saving every step."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sharded = _shard(_llama(0), mesh)
    optimizer = _adamw(sharded)
    resumed = checkpoint.load_latest(directory, sharded, optimizer)
    losses = []
    for step in range((resumed + 1) if resumed is not None else 0, STEPS):
        losses += _train(sharded, optimizer, mesh, [step])
        if losses_file is not None and dist.get_rank() == 0:
            with open(losses_file, "a") as f:
                f.write(json.dumps(losses[-1]) + "\n")
        checkpoint.save_checkpoint(directory, step, sharded, optimizer)
    return resumed, losses


def _run_killed_while_saving(rank, world_size, directory, losses_file):
    write_data = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        written = write_data(self, plan, planner)
        written.wait()  # this rank's shard is on disk; the others' and the metadata may not be
        if rank == KILLED_RANK and str(self.path).endswith(f"step_{KILLED_WHILE_SAVING:08d}"):
            os._exit(1)
        return written

    FileSystemWriter.write_data = write_then_die
    _training_run(directory, losses_file)


def _run_restart_and_reference(rank, world_size, directory, reference_directory):
    return _training_run(directory), _training_run(reference_directory)[1]


def test_resume_after_a_rank_is_killed_mid_save(tmp_path):
    """A rank dies while step 1's checkpoint is being written: the job fails, step 1's
    directory is torn; the restart skips it, resumes after step 0, and the loss sequence
    is exactly the one of a run that never failed (same mesh, bit-exact state)."""
    directory, losses_file = str(tmp_path / "run"), str(tmp_path / "losses.jsonl")
    timeout = datetime.timedelta(seconds=20)
    with pytest.raises(RankFailed, match=f"rank {KILLED_RANK} failed: exit code 1"):
        spawn(_run_killed_while_saving, 4, (directory, losses_file), timeout=timeout)
    with open(losses_file) as f:
        before_crash = [json.loads(line) for line in f]
    assert len(before_crash) == KILLED_WHILE_SAVING + 1  # that step was taken and logged; its save never finished
    torn = checkpoint.step_directory(directory, KILLED_WHILE_SAVING)
    assert _shard_files(torn), "the killed rank wrote its shard before dying"
    assert not os.path.exists(os.path.join(torn, ".metadata"))  # rank 0 never got every rank's write results
    assert not os.path.exists(os.path.join(torn, checkpoint.COMMIT_MARKER))
    with pytest.warns(UserWarning, match="no commit marker"):
        assert checkpoint.latest_checkpoint(directory)[0] == KILLED_WHILE_SAVING - 1

    (resumed, after_restart), reference = spawn(
        _run_restart_and_reference, 4, (directory, str(tmp_path / "reference")), timeout=timeout
    )[0]
    assert resumed == KILLED_WHILE_SAVING - 1
    assert before_crash[:KILLED_WHILE_SAVING] + after_restart == reference
    assert checkpoint.latest_checkpoint(directory)[0] == STEPS - 1  # the torn step was rewritten and committed


# --- torn directories, one process ------------------------------------------------------------


def _plain_run(directory, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = {}
    for step in range(steps):
        model(torch.randn(3, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        checkpoint.save_checkpoint(directory, step, model, optimizer)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return model, optimizer, saved


def _shard_files(path):
    return sorted(name for name in os.listdir(path) if name.endswith(".distcp"))


@pytest.mark.parametrize("tear", ["no marker", "missing shard", "truncated shard", "garbled marker"])
def test_torn_checkpoint_is_refused_and_skipped(tmp_path, tear):
    model, optimizer, saved = _plain_run(tmp_path, steps=2)
    torn = checkpoint.step_directory(tmp_path, 1)
    marker = os.path.join(torn, checkpoint.COMMIT_MARKER)
    shard = os.path.join(torn, _shard_files(torn)[0])
    if tear == "no marker":
        os.remove(marker)
        message = "no commit marker"
    elif tear == "missing shard":
        os.remove(shard)
        message = f"file {os.path.basename(shard)} is missing"
    elif tear == "truncated shard":
        os.truncate(shard, os.path.getsize(shard) // 2)
        message = f"file {os.path.basename(shard)} has .* bytes, the commit marker recorded"
    else:
        with open(marker, "w") as f:
            f.write('{"step": ')
        message = "unreadable commit marker"
    with pytest.raises(ValueError, match=message):
        checkpoint.load_checkpoint(torn, model, optimizer)
    with pytest.warns(UserWarning, match=message):
        assert checkpoint.load_latest(tmp_path, model, optimizer) == 0
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[0][key]), key


def test_marker_lists_every_file_with_its_size(tmp_path):
    _plain_run(tmp_path, steps=1)
    path = checkpoint.step_directory(tmp_path, 0)
    with open(os.path.join(path, checkpoint.COMMIT_MARKER)) as f:
        marker = json.load(f)
    assert marker["step"] == 0
    assert marker["files"] == {
        name: os.path.getsize(os.path.join(path, name)) for name in os.listdir(path) if name != checkpoint.COMMIT_MARKER
    }
    assert ".metadata" in marker["files"]
