"""The example models and one rank's inputs, shared by the single-process tests."""

from __future__ import annotations

import torch

from examples.models import Llama, LlamaConfig, MLPStack, RawLinearNet

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
FEATURES = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))

MODELS = {
    "llama": (lambda: Llama(LlamaConfig()), (TOKENS,)),
    "mlp_stack": (MLPStack, (FEATURES,)),
    "raw_linear": (RawLinearNet, (FEATURES,)),
}
