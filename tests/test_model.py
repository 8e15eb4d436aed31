"""The frozen topology model: construction, validation, derived facts."""

from __future__ import annotations

import dataclasses

import pytest

from agent.topology.model import Gpu, Link, PcieLevel, Topology, pair_score

pytestmark = pytest.mark.usefixtures("impl")  # every test on both engines (conftest.py)


def gpus(n, numa=None):
    return [Gpu(index=i, uuid=f"GPU-{i}", name="T", numa_node=None if numa is None else numa[i]) for i in range(n)]


def test_pair_score_matches_the_go_gpuallocator_scale():
    assert pair_score(0, PcieLevel.SYS) == 10
    assert pair_score(0, PcieLevel.BOARD) == 60
    assert pair_score(2, PcieLevel.NODE) == 220
    assert pair_score(12, None) == 1200


def test_legacy_legends_parse_to_current_levels():
    assert PcieLevel.parse("SOC") is PcieLevel.SYS
    assert PcieLevel.parse(" pix ") is PcieLevel.PIX
    with pytest.raises(KeyError):
        PcieLevel.parse("NV2")


def test_missing_pairs_are_filled_and_link_lookup_is_symmetric(impl):
    t = Topology.build(gpus(4), [Link(2, 0, nvlinks=2, pcie=PcieLevel.SYS)])
    assert len(t.links) == 6
    assert t.link(0, 2) is t.link(2, 0)
    assert (t.link(0, 2).nvlinks, t.link(0, 2).pcie) == (2, PcieLevel.SYS)
    assert t.link(1, 3).nvlinks == 0 and t.link(1, 3).pcie is None
    for a in range(4):
        for b in range(4):
            if a != b:
                link = t.link(a, b)
                assert {link.a, link.b} == {a, b}


def test_scores_islands_and_cliques_of_a_bridged_pair_layout(impl):
    links = [Link(0, 1, 4, PcieLevel.PIX), Link(2, 3, 4, PcieLevel.PIX)]
    links += [Link(a, b, 0, PcieLevel.SYS) for a, b in [(0, 2), (0, 3), (1, 2), (1, 3)]]
    t = Topology.build(gpus(4, numa=[0, 0, 1, 1]), links)
    assert t.scores[0][1] == 450 and t.scores[0][2] == 10
    assert t.set_score([0, 1, 2]) == 450 + 10 + 10
    assert t.nvlink_islands == ((0, 1), (2, 3))
    assert t.nvlink_cliques == ((0, 1), (2, 3))
    assert dict(t.numa_groups) == {0: (0, 1), 1: (2, 3)}


def test_a_mesh_has_one_island_but_several_cliques(impl):
    # DGX-1 hybrid cube mesh: two fully linked quads joined by a ring 0-4,1-5,2-6,3-7
    quad = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    pairs = quad + [(a + 4, b + 4) for a, b in quad] + [(i, i + 4) for i in range(4)]
    t = Topology.build(gpus(8), [Link(a, b, 1, PcieLevel.SYS) for a, b in pairs])
    assert t.nvlink_islands == (tuple(range(8)),)
    assert (0, 1, 2, 3) in t.nvlink_cliques and (4, 5, 6, 7) in t.nvlink_cliques
    assert (0, 4) in t.nvlink_cliques
    assert all(len(c) >= 2 for c in t.nvlink_cliques)


def test_gpus_without_nvlink_form_no_island(impl):
    t = Topology.build(gpus(3), [])
    assert t.nvlink_islands == () and t.nvlink_cliques == ()
    assert dict(t.numa_groups) == {None: (0, 1, 2)}


def test_build_rejects_bad_indices_and_duplicate_links():
    with pytest.raises(ValueError, match="indices"):
        Topology.build([Gpu(index=1, uuid="a", name="x")], [])
    with pytest.raises(ValueError, match="twice"):
        Topology.build(gpus(2), [Link(0, 1, 1), Link(1, 0, 2)])
    with pytest.raises(ValueError, match="distinct"):
        Topology.build(gpus(2), [Link(1, 1, 1)])


def test_topology_is_immutable():
    t = Topology.build(gpus(2), [])
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.source = "x"  # type: ignore[misc]
