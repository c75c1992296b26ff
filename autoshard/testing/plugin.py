"""autoshard's pytest plugin: snapshot and prove a model's sharding in a test, in one process.

Registered through the ``pytest11`` entry point (installed with the package; its
snapshots need the ``testing`` extra, which brings syrupy). It gives:

* ``autoshard_check(model, mesh, example_inputs=..., **options)``: a fixture that
  runs :func:`autoshard.testing.check` and returns its report; when the test fails,
  each report (plan and proof) is added to pytest's output as an ``autoshard`` section.
* ``autoshard_snapshot``: syrupy's ``snapshot`` fixture storing one plain-text file
  per test (:mod:`autoshard.testing.syrupy_extension`). syrupy's own ``snapshot``
  works too and keeps an ``.ambr`` file per test module.
* ``@pytest.mark.autoshard_meshes({"dp": 2, "tp": 2}, {"tp": 8})``: runs the test
  once per mesh (ids ``dp2-tp2``, ``tp8``); ``autoshard_check`` then takes the mesh
  from the marker, and the ``autoshard_mesh`` fixture holds it. A mesh may also be
  written ``"dp=2,tp=4"``, as the command line writes it.

Loading the plugin imports autoshard (and so torch) once per pytest session in an
environment where autoshard is installed; ``-p no:autoshard`` turns it off.
"""

from __future__ import annotations

import pytest

from autoshard.testing.meshes import mesh_id, parse_mesh

_REPORTS = pytest.StashKey[list]()
MARKER = "autoshard_meshes"


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(*meshes): run the test once per mesh, each a dict of axis sizes such as "
        "{'dp': 2, 'tp': 4} or a string 'dp=2,tp=4'; autoshard_check and autoshard_mesh use it",
    )


def pytest_generate_tests(metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None:
        return
    if "autoshard_mesh" not in metafunc.fixturenames:
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid}: marked {MARKER} but uses neither the autoshard_check nor the "
            "autoshard_mesh fixture, so no check would run on those meshes"
        )
    if not marker.args:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: {MARKER} needs at least one mesh")
    try:
        meshes = [parse_mesh(m) for m in marker.args]
    except ValueError as err:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: {err}") from None
    metafunc.parametrize("autoshard_mesh", meshes, ids=[mesh_id(m) for m in meshes])


@pytest.fixture
def autoshard_mesh(request) -> dict[str, int] | None:
    """The mesh of this run of an ``autoshard_meshes`` test (``None`` in an unmarked test)."""
    return getattr(request, "param", None)


@pytest.fixture
def autoshard_check(request, autoshard_mesh):
    """``autoshard_check(model, mesh=None, *, example_inputs, **options)``: the report of
    :func:`autoshard.testing.check`; ``mesh`` comes from the ``autoshard_meshes`` marker
    when the test has one."""
    from autoshard.testing.report import check

    reports = request.node.stash.setdefault(_REPORTS, [])

    def run(model, mesh=None, **kwargs):
        if mesh is not None and autoshard_mesh is not None:
            raise ValueError(
                f"autoshard_check: this test is marked {MARKER} (this run: {autoshard_mesh}); "
                f"leave out the mesh argument ({mesh}) or the marker"
            )
        mesh = autoshard_mesh if mesh is None else parse_mesh(mesh)
        if mesh is None:
            raise ValueError(f"autoshard_check: give a mesh ({{'dp': 2, 'tp': 4}}) or mark the test {MARKER}(...)")
        report = check(model, mesh, **kwargs)
        reports.append(report)
        return report

    return run


@pytest.fixture
def autoshard_snapshot(request):
    """syrupy's snapshot fixture, storing one plain-text file per test."""
    try:
        from autoshard.testing.syrupy_extension import AutoshardSnapshotExtension
    except ImportError:
        raise pytest.UsageError(
            "autoshard_snapshot needs syrupy: pip install 'autoshard[testing]'") from None
    return request.getfixturevalue("snapshot").use_extension(AutoshardSnapshotExtension)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    reports = item.stash.get(_REPORTS, None)
    if reports and report.when == "call" and report.failed:
        report.sections.append(("autoshard", "\n\n".join(str(r) for r in reports)))
    return report
