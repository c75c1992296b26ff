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



# The second tier (`make test-long`, also run by CI): the longer matrices and end-to-end runs. `make test`
# keeps every one-process proof of every pattern on its meshes and one gloo group per multi-process file.
LONG = (
    "tests/test_blocks_kept.py::test_the_patterns_are_proven_in_bf16_on_other_inputs_at_their_fp32_count",
    "tests/test_gpu_check.py::test_gpu_check_prints_one_line_per_check_and_passes_what_runs_here",
    "tests/test_testing_plugin.py::test_command_line_from_an_installed_wheel",
    "tests/test_checkpoint.py::test_resume_after_a_rank_is_killed_mid_save",
    # measured traffic against the prediction on 4 gloo ranks (each count is also proven in one
    # process: the proof's simulated collectives against plan.predicted_comm in test_patterns)
    "tests/test_predicted_comm.py::test_check",
    # HSDP on 8 gloo ranks (its placements and plans are checked in one process in test_plan)
    "tests/test_hsdp.py::test_check",
    # pp x cp trained on 8 gloo ranks (proven in one process in tests/test_pipeline_plan.py)
    "tests/test_pipeline_context.py::test_check",
    # the compile backend on 4 gloo ranks (its bf16 casts and refusals are checked in one process in the
    # same file): for margin under 12 minutes
    "tests/test_compile.py::test_check",
    # FSDP's block-quantized all-gather on 4 gloo ranks (its format, bound and plan are checked in one
    # process in tests/test_block_quant.py)
    "tests/test_quantized_gather.py::test_check",
    # the heaviest 4-rank groups (25-70 s each on a 2-core machine), for margin under 12 minutes: each file's
    # one-process tests stay in the first tier (the patterns and Hugging Face families proven at their exact
    # collectives, the cp proofs, placements on a fake group, the meta and pipeline plans)
    "tests/test_patterns.py::test_pattern",
    "tests/test_hf_models.py::test_hf_model",
    "tests/test_context_parallel.py::test_check",
    "tests/test_sharded_module.py::test_sharded_module",
    "tests/test_frozen_training.py::test_frozen_training",
    "tests/test_checkpoint.py::test_checkpoint",
    "tests/test_meta_device.py::test_meta_device",
    "tests/test_pipeline.py::test_check",
    "tests/test_parity.py::test_parity",
    "tests/test_training.py::test_training",
    # expert parallelism trained on 4 gloo ranks (its plans, choices and refusals are checked in one process
    # in tests/test_ep_plans.py)
    "tests/test_expert_parallel.py::test_check",
    # expert parallelism with pp and cp on 8 gloo ranks (proven in one process in tests/test_ep_plans.py)
    "tests/test_expert_meshes.py::test_check",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[")[0] in LONG:
            item.add_marker(pytest.mark.long)
