import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # `examples` is importable from tests and their spawned ranks

pytest_plugins = ["pytester"]  # the plugin's own tests drive pytest in pytest


import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402


@pytest.fixture(scope="module")
def fake_world():
    """A 4-rank fake process group in this process: plans and graphs without real ranks.

    Collectives are no-ops, so numerics are not checked here; the distributed
    test files do that on real gloo ranks. Module-scoped: single-process tests
    of other files (checkpoints without a process group) must not see it.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()

