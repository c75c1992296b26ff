"""``autoshard.testing.check`` and ``python -m autoshard check``, in this process."""

from __future__ import annotations

import os
import re

import pytest
import torch

import autoshard.testing
from autoshard.adapters.cli import main
from autoshard.driver import planning
from autoshard.runtime import collectives
from autoshard.testing.meshes import mesh_id, parse_mesh
from tests.cases import MODELS

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "user_tests")


def _llama_report(mesh=None, **options):
    build, inputs = MODELS["llama"]
    torch.manual_seed(0)
    return autoshard.testing.check(build(), mesh or {"dp": 2, "tp": 2}, example_inputs=inputs, **options)


@pytest.fixture
def dropped_all_reduce(monkeypatch):
    """Emission that forgets the first block's first forward all-reduce (a rowwise output
    reaches the residual add as a partial sum)."""
    emit = planning.emit

    def broken(*args, **kwargs):
        emitted = emit(*args, **kwargs)
        block = next(iter(emitted.parts.blocks.values()))
        node = next(n for n in block.graph.nodes if n.target is collectives.REDUCE_PARTIAL)
        node.replace_all_uses_with(node.args[0])
        block.graph.erase_node(node)
        block.recompile()
        return emitted

    monkeypatch.setattr(planning, "emit", broken)


def test_report_holds_plan_code_prediction_and_proof():
    report = _llama_report()
    report.assert_close()
    assert report.mesh == {"dp": 2, "tp": 2} and report.model == "Llama"
    assert [u.unit for u in report.code] == ["<root>", "layers.0", "layers.1"]
    assert report.plan.params["layers.0.attention.wo.weight"].role == "rowwise"
    assert report.proof.ok and report.proof.tp == 2
    # what the emitted code ran is what the plan predicts
    assert report.proof.tp_collectives == report.predicted_comm()["tp"]
    assert set(report.predicted_comm()) == {"dp", "tp"}
    block = report.code[1].code
    assert block.count("torch.ops.autoshard.reduce_partial") == 2 and block.count("torch.ops.autoshard.enter_tp") == 2


def test_snapshot_is_stable_and_normalized():
    first, second = _llama_report(), _llama_report()
    text = first.snapshot()
    assert text == second.snapshot()
    assert text.startswith("autoshard snapshot: Llama on dp=2 x tp=2\n\n== plan ==\nautoshard plan v2")
    assert "== predicted collectives per training step ==" in text
    assert re.search(r"^tp\s+all_reduce\s+9\s+73,728$", text, re.MULTILINE)
    assert "== code: layers.1 ==\nsame code as layers.0 (names aside)" in text
    assert "models.py `" in text and not re.search(r"\.py:\d", text)  # no line numbers
    assert "proof" not in text and " s)" not in text  # no errors, no timings
    assert text.endswith("\n") and not any(line != line.rstrip() for line in text.splitlines())


def test_snapshot_names_the_options_that_change_the_plan():
    text = _llama_report({"dp": 2, "tp": 2}, sequence_parallel=True).snapshot()
    assert text.splitlines()[1] == "options: sequence_parallel=True"
    assert "reduce_scatter" in text


def test_assert_close_names_the_first_diverging_node(dropped_all_reduce):
    report = _llama_report()
    assert not report.proof.ok
    with pytest.raises(AssertionError) as failure:
        report.assert_close()
    message = str(failure.value)
    assert message.startswith("autoshard: Llama on dp=2 x tp=2: the sharded code differs from the unsharded model")
    assert "in 22 of 22 outputs and gradients" in message
    # both runs against float64, and how many times one device's error sharding costs
    assert re.search(r"^  gradient of '[\w.]+': \d\.\d\de[-+]\d+ from float64 sharded, "
                     r"\d\.\d\de[-+]\d+ on one device \(x[\d.e+]+; allowed", message, re.MULTILINE), message
    assert re.search(r"first divergence: node 'add_2' \(add.Tensor\) at models.py:\d+ `", message), message


def test_assert_close_with_a_tighter_tolerance():
    report = _llama_report()
    report.assert_close(rtol=1e-3)
    with pytest.raises(AssertionError, match="(?s)beyond rtol 1e-20 .*pass rtol=1e-20 to check"):
        report.assert_close(rtol=1e-20)


def test_kept_values_replay_each_rank():
    report = _llama_report({"tp": 2}, keep_values=True)
    values = report.values
    assert values is not None and len(values.args) == 1 and values.args[0].dtype == torch.long
    assert set(values.weights) == set(report.plan.params)
    assert len(values.losses) == 2 and values.losses[0] == pytest.approx(values.losses[1], rel=1e-6)
    wq = values.gradients["layers.0.attention.wq.weight"]  # stored transposed [in, out], out cut over tp
    assert [tuple(g.shape) for g in wq] == [(64, 32), (64, 32)]
    assert _llama_report({"tp": 2}).values is None


def test_mesh_spellings():
    assert parse_mesh("dp=2,tp=4") == parse_mesh({"dp": 2, "tp": 4}) == {"dp": 2, "tp": 4}
    assert mesh_id({"dp": 2, "tp": 4}) == "dp2-tp4"
    for bad in ("dp:2", "dp=2,tp=x", {"tp": 0}, {}, ["tp", 2]):
        with pytest.raises(ValueError, match="autoshard: a mesh"):
            parse_mesh(bad)
    build, inputs = MODELS["llama"]
    with pytest.raises(ValueError, match="`mesh` is a dict of axis sizes"):
        autoshard.testing.check(build(), "dp=2,tp=2", example_inputs=inputs)


# --- the command line --------------------------------------------------------------------------


@pytest.fixture
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLE)
    yield
    import sys

    sys.modules.pop("tiny_lm", None)


def _cli(*args):
    return main(["check", "tiny_lm:build_model", "--input", "randint(0, 512, (2, 32))", *args])


def test_cli_prints_plan_and_proof_and_time(example_on_path, capsys):
    assert _cli("--mesh", "dp=2,tp=2", "--mesh", "tp=4") == 0
    out = capsys.readouterr().out
    assert "autoshard plan v2  mesh dp=2 x tp=2" in out and "autoshard plan v2  mesh tp=4" in out
    assert re.search(r"autoshard proof on tp=4: proven", out)
    assert re.search(r"tiny_lm:build_model on dp2-tp2: checked in [\d.]+ s", out)
    assert re.search(r"autoshard check: 2 mesh\(es\), all proven, [\d.]+ s in all", out)


def test_cli_snapshots(example_on_path, tmp_path, capsys):
    directory = str(tmp_path / "snaps")
    path = os.path.join(directory, "tiny_lm-build_model-tp4.txt")
    assert _cli("--mesh", "tp=4", "--snapshot", directory) == 0
    assert f"snapshot {path}: written" in capsys.readouterr().out
    with open(path) as f:
        assert f.read().startswith("autoshard snapshot: TinyLM on tp=4\n")
    assert _cli("--mesh", "tp=4", "--snapshot", directory) == 0
    assert f"snapshot {path}: unchanged" in capsys.readouterr().out
    assert _cli("--mesh", "tp=4", "--snapshot", directory, "--sequence-parallel") == 1
    out = capsys.readouterr().out
    assert f"snapshot {path} differs (rewrite it with --snapshot-update)" in out
    assert re.search(r"^\+options: sequence_parallel=True$", out, re.MULTILINE)
    assert "autoshard check: 1 mesh(es), 1 failed" in out
    assert _cli("--mesh", "tp=4", "--snapshot", directory, "--sequence-parallel", "--snapshot-update") == 0
    assert f"snapshot {path}: updated" in capsys.readouterr().out


def test_cli_exits_1_when_the_proof_fails(dropped_all_reduce, capsys):
    build = "tests.cases:MODELS"  # not callable into a model: the usage error path first
    assert main(["check", build, "--mesh", "tp=2", "--input", "randint(0, 256, (2, 16))"]) == 2
    assert "tests.cases:MODELS is a dict, neither an nn.Module nor a function returning one" in capsys.readouterr().err
    code = main(["check", "examples.models:Llama", "--mesh", "dp=2,tp=2", "--input", "randint(0, 256, (2, 16))"])
    out = capsys.readouterr().out
    assert code == 1
    assert "autoshard proof on tp=2: FAILED" in out and "first divergence: node 'add_2'" in out


@pytest.mark.parametrize("args, message", [
    (["nowhere:build"], "cannot import 'nowhere'"),
    (["tiny_lm:missing"], "'tiny_lm' has no attribute 'missing'"),
    (["tiny_lm"], "the target is written module:attribute"),
    (["tiny_lm:build_model", "--input", "randint(0, 512, (2, 32))", "--kwarg", "2x=ones(1)"], "--kwarg is written"),
    (["tiny_lm:build_model"], "give the model's inputs with --input"),
    (["tiny_lm:build_model", "--input", "open('x')"], "does not evaluate: NameError"),
])
def test_cli_usage_errors_exit_2(example_on_path, capsys, args, message):
    assert main(["check", *args, "--mesh", "tp=2"]) == 2
    assert message in capsys.readouterr().err


def test_cli_reports_what_autoshard_refuses_as_a_usage_error(example_on_path, capsys):
    assert _cli("--mesh", "xp=2") == 2
    assert capsys.readouterr().err.startswith(
        "autoshard check: error: tiny_lm:build_model on xp2: autoshard: unknown mesh axes ['xp']")
