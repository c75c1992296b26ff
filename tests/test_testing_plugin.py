"""The pytest plugin and the command line, driven as a user drives them.

* The example project ``examples/user_tests`` runs under ``pytester`` (pytest in
  pytest): a missing snapshot fails, ``--snapshot-update`` writes it, the same run
  passes, an extra linear in the MLP fails with a readable diff, ``--snapshot-update``
  accepts it.
* ``python -m autoshard check`` runs from a wheel installed in a new virtual
  environment holding only autoshard's declared dependencies (torch and sympy,
  linked from this environment; nothing is downloaded).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "user_tests")
MODEL_CHANGE = ("    mlp_extra_linear: bool = False", "    mlp_extra_linear: bool = True")


@pytest.fixture(scope="module", autouse=True)
def _torch_modules_imported():
    """Run the example's checks once out here first. pytester's in-process runs drop the modules
    each run imported; torch modules that export imports lazily register themselves globally and
    must not be imported twice, so they have to be imported before the first run."""
    sys.path.insert(0, EXAMPLE)
    try:
        from tiny_lm import build_model, example_tokens

        import autoshard.testing

        for options in ({}, {"sequence_parallel": True}):
            autoshard.testing.check(build_model(), {"dp": 2, "tp": 4}, example_inputs=(example_tokens(),), **options)
    finally:
        sys.path.remove(EXAMPLE)
        sys.modules.pop("tiny_lm", None)


def _example_project(pytester) -> None:
    for name in ("tiny_lm.py", "test_sharding.py"):
        shutil.copy(os.path.join(EXAMPLE, name), pytester.path / name)


def _run(pytester, *args):
    sys.modules.pop("tiny_lm", None)  # the edited model file is imported afresh
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)


def test_snapshot_workflow_of_the_example_project(pytester):
    _example_project(pytester)

    missing = _run(pytester)
    missing.assert_outcomes(failed=4)
    missing.stdout.fnmatch_lines(["*4 snapshots failed*"])

    created = _run(pytester, "--snapshot-update")
    created.assert_outcomes(passed=4)
    created.stdout.fnmatch_lines(["*4 snapshots generated*"])
    stored = sorted(p.name for p in (pytester.path / "__snapshots__" / "test_sharding").iterdir())
    assert stored == ["test_tiny_lm_shards[dp2-tp2].txt", "test_tiny_lm_shards[dp2-tp4].txt",
                      "test_tiny_lm_shards[tp8].txt", "test_tiny_lm_with_sequence_parallelism.txt"]
    text = (pytester.path / "__snapshots__" / "test_sharding" / "test_tiny_lm_shards[dp2-tp4].txt").read_text()
    assert text.startswith("autoshard snapshot: TinyLM on dp=2 x tp=4\n")
    assert "blocks.0.mlp.down_proj.weight" in text and "== code: blocks.1 ==\nsame code as blocks.0" in text
    # the committed snapshots of the example are exactly what a fresh run writes
    committed = os.path.join(EXAMPLE, "__snapshots__", "test_sharding", "test_tiny_lm_shards[dp2-tp4].txt")
    with open(committed) as f:
        assert f.read() == text

    again = _run(pytester)
    again.assert_outcomes(passed=4)

    model = pytester.path / "tiny_lm.py"
    source = model.read_text()
    assert source.count(MODEL_CHANGE[0]) == 1
    model.write_text(source.replace(*MODEL_CHANGE))
    changed = _run(pytester, "-vv")
    changed.assert_outcomes(failed=4)
    out = changed.stdout.str()
    # a readable diff: the new parameter's plan row and its code appear as added lines
    assert re.search(r"^E\s+\+ blocks\.0\.mlp\.extra_proj\.weight\s+\w+", out, re.MULTILINE), out[-3000:]
    assert re.search(r"^E\s+\+ .*extra_proj", out, re.MULTILINE)
    assert "Traceback" not in out

    accepted = _run(pytester, "--snapshot-update")
    accepted.assert_outcomes(passed=4)
    accepted.stdout.fnmatch_lines(["*4 snapshots updated*"])
    _run(pytester).assert_outcomes(passed=4)


def test_marker_without_the_fixtures_is_a_usage_error(pytester):
    pytester.makepyfile(test_marked="""
        import pytest

        @pytest.mark.autoshard_meshes({"tp": 2})
        def test_nothing():
            pass
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*marked autoshard_meshes but uses neither*"])
    assert result.ret != 0


def test_mesh_comes_from_the_marker_or_the_call_not_both(pytester):
    pytester.makepyfile(test_meshes="""
        import pytest, torch.nn as nn

        @pytest.mark.autoshard_meshes({"tp": 2}, "dp=2,tp=2")
        def test_both(autoshard_check, autoshard_mesh):
            assert autoshard_mesh in ({"tp": 2}, {"dp": 2, "tp": 2})
            autoshard_check(nn.Linear(4, 4), {"tp": 4}, example_inputs=())

        def test_neither(autoshard_check, autoshard_mesh):
            assert autoshard_mesh is None
            autoshard_check(nn.Linear(4, 4), example_inputs=())
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-v")
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(["*test_both?tp2? FAILED*", "*test_both?dp2-tp2? FAILED*"])
    result.stdout.fnmatch_lines(["*marked autoshard_meshes (this run: {'tp': 2}); leave out the mesh argument*"])
    result.stdout.fnmatch_lines(["*give a mesh ({'dp': 2, 'tp': 4}) or mark the test autoshard_meshes(...)*"])


def test_failing_check_shows_the_report_in_the_test_output(pytester):
    """A failing test that ran a check gets an ``autoshard`` section: the plan and the proof."""
    _example_project(pytester)
    pytester.makepyfile(test_fails="""
        from tiny_lm import build_model, example_tokens

        def test_fails_after_check(autoshard_check):
            autoshard_check(build_model(), "dp=2,tp=2", example_inputs=(example_tokens(),))
            assert False, "the test's own failure"
    """)
    result = _run(pytester, "test_fails.py")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*- autoshard -*", "autoshard.testing report: TinyLM on dp=2 x tp=2*",
                                 "autoshard plan v2  mesh dp=2 x tp=2*"])


# --- the command line from an installed package ------------------------------------------------


def _requirements_closure(names: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``names`` need, recursively (extras and markers not taken)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = re.split(r"[ ;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found[name] = dist
        todo += [r for r in dist.requires or [] if "extra ==" not in r]
    return list(found.values())


def _new_venv_with_dependencies(path) -> str:
    """A new virtual environment whose site-packages links only torch, sympy and what they need."""
    venv.create(path, with_pip=False, symlinks=True)
    python = os.path.join(path, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    here = sysconfig.get_paths()["purelib"]
    for dist in _requirements_closure(["torch", "sympy"]):
        tops = {f.parts[0] for f in dist.files or () if f.parts and f.parts[0] != ".."}
        for top in tops:
            source = os.path.join(here, top)
            if os.path.exists(source) and not os.path.exists(os.path.join(site, top)):
                os.symlink(source, os.path.join(site, top))
    return python


def test_command_line_from_an_installed_wheel(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    for package in ("autoshard", "passes"):
        shutil.copytree(os.path.join(ROOT, package), source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheels"),
                    str(source)], check=True, capture_output=True)
    python = _new_venv_with_dependencies(str(tmp_path / "venv"))
    wheel = next((tmp_path / "wheels").glob("autoshard-*.whl"))
    subprocess.run([*pip, "--python", python, "install", "--quiet", "--no-index", str(wheel)], check=True,
                   capture_output=True)

    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(os.path.join(EXAMPLE, "tiny_lm.py"), project / "tiny_lm.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}

    def cli(*args):
        return subprocess.run([python, "-m", "autoshard", "check", "tiny_lm:build_model", *args], cwd=project,
                              env=env, capture_output=True, text=True, timeout=300)

    where = subprocess.run([python, "-c", "import autoshard; print(autoshard.__file__)"], cwd=project, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(tmp_path / "venv")), where  # the installed copy, not this checkout

    snapshots = tmp_path / "snapshots"
    first = cli("--mesh", "dp=2,tp=4", "--mesh", "tp=8", "--input", "randint(0, 512, (2, 32))",
                "--snapshot", str(snapshots))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "autoshard plan v2  mesh dp=2 x tp=4" in first.stdout
    assert re.search(r"autoshard proof on tp=8: proven .*", first.stdout)
    assert re.search(r"autoshard check: 2 mesh\(es\), all proven, [\d.]+ s in all", first.stdout)
    assert sorted(p.name for p in snapshots.iterdir()) == ["tiny_lm-build_model-dp2-tp4.txt",
                                                            "tiny_lm-build_model-tp8.txt"]

    source_text = (project / "tiny_lm.py").read_text()
    (project / "tiny_lm.py").write_text(source_text.replace(*MODEL_CHANGE))
    changed = cli("--mesh", "dp=2,tp=4", "--input", "randint(0, 512, (2, 32))", "--snapshot", str(snapshots))
    assert changed.returncode == 1, changed.stdout + changed.stderr
    assert "differs (rewrite it with --snapshot-update)" in changed.stdout
    assert re.search(r"^\+blocks\.0\.mlp\.extra_proj\.weight", changed.stdout, re.MULTILINE)

    bad = cli("--mesh", "dp=2,tp=4", "--input", "randint(0, 512, (2, 32)")
    assert bad.returncode == 2 and "--input 'randint(0, 512, (2, 32)' does not evaluate" in bad.stderr


@pytest.fixture(autouse=True)
def _no_leftover_model_module():
    yield
    sys.modules.pop("tiny_lm", None)
