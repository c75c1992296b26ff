"""The proof's simulator by itself: its grid of ranks, and collectives run side by side.

The simulator, the cp proof and the pipeline's stage shapes all index their per-rank values by
one grid (:class:`~autoshard.proof.rank_grid.RankGrid`), so its layout is the fact they share:
row-major in the mesh's axis order, a group of an axis being the ranks that differ only in that
axis's coordinate. On a hand-written graph the simulator's collectives then do, forward and
backward, what the real ones do over those groups, and tally what a real rank sends.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.proof.rank_grid import RankGrid
from autoshard.proof.simulate import PerRank, RankSimulator
from autoshard.runtime import collectives, context_ops


def test_ranks_are_numbered_row_major_in_mesh_order_as_a_device_mesh_numbers_them():
    grid = RankGrid.of(tp=4, cp=2)  # given in any order, laid out as the mesh orders axes
    assert grid.sizes == (("cp", 2), ("tp", 4)) and grid.ranks == 8
    mesh = torch.arange(8).view(2, 4)  # what init_device_mesh((2, 4), ("cp", "tp")) holds
    for rank in grid:
        cp, tp = (mesh == rank).nonzero()[0].tolist()
        assert (grid.coordinate(rank, "cp"), grid.coordinate(rank, "tp")) == (cp, tp)


def test_a_group_of_an_axis_is_the_ranks_differing_only_in_its_coordinate():
    grid = RankGrid.of(cp=2, tp=4)
    assert grid.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.groups("cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.ranks_where(tp=1) == [1, 5]


def test_an_axis_of_one_rank_is_left_off_and_its_groups_are_single_ranks():
    grid = RankGrid.of(cp=1, tp=2)
    assert grid.sizes == (("tp", 2),)
    assert grid.groups("cp") == [[0], [1]] and grid.coordinate(1, "cp") == 0
    assert grid.ranks_where(tp=0) == [0]


def test_a_third_axis_keeps_the_layout_of_a_three_dimensional_mesh():
    grid = RankGrid.of(dp=2, cp=2, tp=2)
    mesh = torch.arange(8).view(2, 2, 2)
    for rank in grid:
        assert [grid.coordinate(rank, a) for a in ("dp", "cp", "tp")] == (mesh == rank).nonzero()[0].tolist()
    assert grid.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def _graph(build) -> fx.GraphModule:
    """A GraphModule of one input ``x`` whose body ``build(graph, x)`` returns the output node."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(build(graph, x))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_tp_sum_of_partials_adds_the_ranks_and_its_backward_hands_each_rank_the_whole_gradient():
    """``enter_tp``, a per-rank scale, ``reduce_partial``: forward sums the tp ranks' partial values;
    backward passes the gradient through the reduce and sums it over the ranks at enter_tp."""
    gm = _graph(lambda g, x: g.call_function(collectives.REDUCE_PARTIAL,
                                             (g.call_function(torch.mul, (g.call_function(collectives.ENTER_TP,
                                                                                          (x, "tp")), 2.0)), "tp")))
    x = torch.randn(3, 4, requires_grad=True)
    inputs = [x.clone().detach().requires_grad_(True) for _ in range(2)]
    simulator = RankSimulator(gm, RankGrid.of(tp=2), lambda name: None)
    out = simulator.run(PerRank(inputs))
    for value in out.values:
        torch.testing.assert_close(value, 4 * x.detach())  # 2 ranks x 2x each
    torch.autograd.backward(out.values, [torch.ones(3, 4)] * 2)
    for given in inputs:  # each rank's input gradient: the sum over ranks of 2 x its output's
        torch.testing.assert_close(given.grad, torch.full((3, 4), 4.0))
    # one all-reduce each way, of 3 x 4 float32 (48 bytes): a ring of 2 sends 2 (n - 1) / n of it per rank
    assert simulator.tally.result()["tp"] == {"all_reduce": (2, 2 * 48)}


def test_a_cp_gather_on_the_cp_by_tp_grid_joins_each_tp_ranks_cp_group_in_sequence_order():
    """On cp=2 x tp=2, ``cp_gather`` along the sequence combines ranks {0, 2} and {1, 3} (one per
    tp rank), putting the load-balanced chunks back in global order."""
    seq, cp = 8, 2
    gm = _graph(lambda g, x: g.call_function(context_ops.CP_GATHER, (x, 0, cp, "cp")))
    whole = torch.arange(seq, dtype=torch.float32)
    grid = RankGrid.of(cp=cp, tp=2)
    parts = [whole[context_ops.local_positions(grid.coordinate(r, "cp"), cp, seq)] + 100 * grid.coordinate(r, "tp")
             for r in grid]
    out = RankSimulator(gm, grid, lambda name: None).run(PerRank(parts))
    for rank, value in enumerate(out.values):
        torch.testing.assert_close(value, whole + 100 * grid.coordinate(rank, "tp"))
