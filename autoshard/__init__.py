"""autoshard: turn a single-device model into a 2-D (FSDP x tensor parallel) one.

Every linear weight is stored so that tensor parallelism cuts dim 1 and FSDP
cuts dim 0: colwise weights transposed to ``[in, out]``, rowwise weights as
``[out, in]``. Each weight is then one clean block ``(dp: Shard(0), tp:
Shard(1))``, and the emitted graph issues two tp all-reduces per transformer
block in forward and two in backward.

    sharded = autoshard.autoshard(model, mesh, example_inputs=(batch,))
    print(autoshard.plan(model, mesh, example_inputs=(batch,)))
"""

# collectives registers the torch.ops.autoshard ops; testing is autoshard.testing.check and its report
from autoshard import testing
from autoshard.adapters.backend import backend, register_backend_name
from autoshard.adapters.checkpoint import full_state_dict, load_latest, save_checkpoint
from autoshard.adapters.launch import PeerFailed, RankFailed
from autoshard.advice.suggest import Links, suggest_mesh
from autoshard.api import autoshard, check, plan
from autoshard.core.errors import InternalError
from autoshard.core.mesh import data_parallel_rank
from autoshard.core.options import (
    CaptureOptions,
    ContextOptions,
    Options,
    PipelineOptions,
    PrecisionOptions,
    ShardingOptions,
    TensorOptions,
)
from autoshard.core.quant_format import BlockQuant
from autoshard.passes.capture import CaptureError
from autoshard.plans.plan import ParamSharding, Plan
from autoshard.proof.proof import Proof, ProofError
from autoshard.proof.simulate import EmittedCodeError
from autoshard.runtime import collectives  # noqa: F401
from autoshard.runtime.clipping import clip_grad_norm_

register_backend_name()  # torch.compile(model, backend="autoshard", options={"mesh": mesh})

__all__ = ["autoshard", "plan", "check", "Proof", "ProofError", "Options", "TensorOptions", "ContextOptions",
           "PipelineOptions", "PrecisionOptions", "CaptureOptions", "ShardingOptions",
           "backend", "Plan", "ParamSharding", "full_state_dict", "save_checkpoint", "load_latest",
           "data_parallel_rank", "BlockQuant", "suggest_mesh", "Links", "testing", "clip_grad_norm_",
           # the errors a user can meet
           "CaptureError", "EmittedCodeError", "InternalError", "PeerFailed", "RankFailed"]
