"""Reading pasted ``nvidia-smi topo -m`` output (agent/hw/topo_matrix.py).

Fixtures are in tests/fixtures/topo/ (README.md there says where each came from).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.errors import InputFormatError
from agent.hw.topo_matrix import (
    TopoMatrixError,
    matrix_name,
)
from agent.hw.topo_matrix import parse_topo_matrix as parse_facts
from agent.hw.topo_matrix import read_topo_matrix as read_facts
from agent.records import synthetic_gpu_uuid
from agent.topology.model import PcieLevel, Topology

pytestmark = pytest.mark.usefixtures("impl")  # every test on both engines (conftest.py)

FIXTURES = Path(__file__).parent / "fixtures" / "topo"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
REAL_FILES = sorted(EXPECTED)


def parse_topo_matrix(text: str, source: str = "<text>") -> Topology:
    """What the parser states, as a topology (islands, cliques and scores are derived)."""
    return Topology.from_facts(parse_facts(text, source=source))


def read_topo_matrix(path: object) -> Topology:
    return Topology.from_facts(read_facts(path))  # type: ignore[arg-type]


def read(name: str) -> Topology:
    """What the parser states, as a topology (islands, cliques and scores are derived)."""
    return read_topo_matrix(FIXTURES / name)


def nvlinked(topology: Topology) -> list[list[int]]:
    return [[link.a, link.b, link.nvlinks] for link in topology.links if link.nvlinks]


# ----------------------------------------------------------- independent reference facts
def reference_islands(n: int, pairs) -> list[tuple[int, ...]]:
    """Connected components (>= 2 GPUs) of the NVLink graph, by union-find."""
    parent = list(range(n))

    def find(x):
        while parent[x] != x:
            x = parent[x]
        return x

    for a, b, *_ in pairs:
        parent[find(a)] = find(b)
    comps: dict[int, list[int]] = {}
    for i in range(n):
        comps.setdefault(find(i), []).append(i)
    return sorted(tuple(c) for c in comps.values() if len(c) >= 2)


def reference_cliques(n: int, pairs) -> list[tuple[int, ...]]:
    """Maximal NVLink cliques (>= 2 GPUs) by brute force over all subsets."""
    linked = {(a, b) for a, b, *_ in pairs} | {(b, a) for a, b, *_ in pairs}
    cliques = [
        set(s)
        for size in range(2, n + 1)
        for s in itertools.combinations(range(n), size)
        if all((x, y) in linked for x, y in itertools.combinations(s, 2))
    ]
    maximal = [c for c in cliques if not any(c < d for d in cliques)]
    return sorted(tuple(sorted(c)) for c in maximal)


# ------------------------------------------------------------------ the five real files
@pytest.mark.parametrize("name", REAL_FILES)
def test_real_output_yields_the_gpus_links_and_nics_expected_json_lists(name):
    want = EXPECTED[name]
    topo = read(name)
    assert topo.gpu_count == want["gpus"]
    assert nvlinked(topo) == want["nvlink"]
    assert [nic.name for nic in topo.nics] == want["nics"]
    assert all(len(nic.levels) == want["gpus"] for nic in topo.nics)
    if want["numa"] is None:
        assert all(g.numa_node is None for g in topo.gpus)
        assert any("no NUMA Affinity column" in note for note in topo.notes)
    else:
        for gpu, numa in zip(topo.gpus, want["numa"], strict=True):
            if isinstance(numa, str):  # a list of nodes: the lowest, the raw list in a note
                assert gpu.numa_node == min(int(p.split("-")[0]) for p in numa.split(","))
                assert any(numa in note for note in topo.notes)
            else:
                assert gpu.numa_node == numa


@pytest.mark.parametrize("name", REAL_FILES)
def test_real_output_has_the_nvlink_islands_and_cliques_of_its_links(name):
    want = EXPECTED[name]
    topo = read(name)
    assert sorted(topo.nvlink_islands) == reference_islands(want["gpus"], want["nvlink"])
    assert sorted(topo.nvlink_cliques) == reference_cliques(want["gpus"], want["nvlink"])


def test_dgx1_hybrid_cube_mesh_is_one_island_of_two_quads_and_four_cross_pairs():
    topo = read("dgx1-v100-8gpu-4nic.txt")
    assert topo.nvlink_islands == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert topo.nvlink_cliques == ((0, 1, 2, 3), (0, 4), (1, 5), (2, 6), (3, 7), (4, 5, 6, 7))


def test_dgx1_nvlinks_and_pcie_match_go_gpuallocators_own_dgx1_volta_test_node():
    # go-gpuallocator's NewDGX1VoltaNode, as data (tests/fixtures/gpuallocator_cases.json,
    # owned by the allocator tests): an independent account of the same machine.
    cases = json.loads((FIXTURES.parent / "gpuallocator_cases.json").read_text())
    volta = next(t for t in cases["topologies"] if t["name"] == "DGX-1-Volta-V100")
    topo = read("dgx1-v100-8gpu-4nic.txt")
    nvlinks = [[0 if a == b else topo.link(a, b).nvlinks for b in range(8)] for a in range(8)]
    assert nvlinks == volta["nvlinks"]
    for a, b in itertools.combinations(range(8), 2):
        if not volta["nvlinks"][a][b]:
            assert topo.link(a, b).pcie.name == volta["pcie"][a][b], (a, b)


@pytest.mark.parametrize("name", REAL_FILES)
def test_gpus_get_synthetic_stable_uuids_unknown_names_and_the_source(name):
    topo = read(name)
    machine = matrix_name(name)
    assert [g.uuid for g in topo.gpus] == [
        synthetic_gpu_uuid(machine, i) for i in range(topo.gpu_count)
    ]
    assert all(g.name == "unknown" and g.pci_bus_id == "" for g in topo.gpus)
    assert topo.source == f"topo-matrix:{FIXTURES / name}"
    assert all(not link.nvswitch for link in topo.links)


def test_synthetic_uuids_are_stable_and_differ_by_machine_and_index():
    assert synthetic_gpu_uuid("box", 3) == synthetic_gpu_uuid("box", 3)
    assert len({synthetic_gpu_uuid(m, i) for m in ("a", "b") for i in range(3)}) == 6
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
                        synthetic_gpu_uuid("box", 3))


def test_pcie_levels_are_read_for_pairs_without_nvlink():
    topo = read("l40s-4gpu-2socket-2nic.txt")
    assert topo.link(0, 1).pcie is PcieLevel.NODE
    assert topo.link(0, 2).pcie is PcieLevel.SYS
    assert topo.link(2, 3).pcie is PcieLevel.NODE
    assert not any("NV#" in note for note in topo.notes)  # nothing was inferred


def test_nvlinked_pairs_get_node_on_the_same_numa_node_and_sys_across():
    h200 = read("h200-8gpu-8nic-epyc9534.txt")
    assert h200.link(0, 3).pcie is PcieLevel.NODE
    assert h200.link(3, 4).pcie is PcieLevel.SYS
    a100 = read("a100-80gb-pcie-4gpu-nv12-bridge-pairs-4numa-vm.txt")  # one NUMA node per GPU
    assert a100.link(0, 1).pcie is PcieLevel.SYS
    assert any("inferred" in note and "SYS for 0-1 2-3" in note for note in a100.notes)


def test_without_numa_column_gpus_are_grouped_by_cpu_affinity():
    topo = read("dgx1-v100-8gpu-4nic.txt")
    assert [g.cpu_affinity for g in topo.gpus] == ["0-19,40-59"] * 4 + ["20-39,60-79"] * 4
    assert topo.link(0, 3).pcie is PcieLevel.NODE  # NV2, same affinity
    assert topo.link(0, 4).pcie is PcieLevel.SYS  # NV2, other socket
    assert topo.numa_groups == {None: tuple(range(8))}
    assert any("group 1 = GPU 4,5,6,7 (20-39,60-79)" in note for note in topo.notes)


def test_nic_levels_come_from_the_gpu_rows_and_legend_names_replace_nic_columns():
    h200 = read("h200-8gpu-8nic-epyc9534.txt")
    nic0 = h200.nics[0]
    assert nic0.name == "mlx5_0"
    assert [lv.name for lv in nic0.levels] == [
        "NODE",
        "NODE",
        "PIX",
        "NODE",
        "SYS",
        "SYS",
        "SYS",
        "SYS",
    ]
    dgx1 = read("dgx1-v100-8gpu-4nic.txt")
    assert dgx1.nics[1].name == "mlx5_2"
    assert [lv.name for lv in dgx1.nics[1].levels] == ["SYS"] * 4 + ["PIX", "PIX", "PHB", "PHB"]


def test_gb200_gpu_numa_ids_and_node_lists_are_kept_in_notes():
    topo = read("gb200-4gpu-8nic.txt")
    assert [g.numa_node for g in topo.gpus] == [0, 0, 1, 1]
    assert [g.cpu_affinity for g in topo.gpus] == ["0-71", "0-71", "72-143", "72-143"]
    assert any("GPU0=2, GPU1=10, GPU2=18, GPU3=26" in note for note in topo.notes)
    assert any("GPU2 1,19-25,27-33 -> 1" in note for note in topo.notes)


def test_a100_reads_the_extra_empty_cell_before_gpu_numa_id():
    topo = read("a100-80gb-pcie-4gpu-nv12-bridge-pairs-4numa-vm.txt")
    assert [g.cpu_affinity for g in topo.gpus] == ["0-23", "24-47", "48-71", "72-95"]
    assert not any("GPU NUMA ID" in note for note in topo.notes)  # all N/A


def test_space_aligned_output_with_empty_cpu_affinity_cells():
    topo = read("h200-8gpu-10nic-blank-cpu-affinity.txt")
    assert [g.cpu_affinity for g in topo.gpus] == [None] * 4 + ["56"] * 4
    assert [g.numa_node for g in topo.gpus] == [0] * 4 + [1] * 4
    assert topo.nvlink_cliques == (tuple(range(8)),)
    assert [n.name for n in topo.nics] == [f"mlx5_{k}" for k in range(10)]
    pix = [[i for i, lv in enumerate(n.levels) if lv is PcieLevel.PIX] for n in topo.nics]
    assert pix == [[0], [], [], [1], [2], [3], [4], [5], [6], [7]]
    assert topo.link(0, 4).pcie is PcieLevel.SYS and topo.link(0, 3).pcie is PcieLevel.NODE


def test_hand_aligned_tabs_with_doubled_separators_are_read_by_their_words():
    topo = read("v100-8gpu-2nic-hand-aligned-tabs.txt")
    assert nvlinked(topo) == [
        [0, 1, 1],
        [0, 2, 2],
        [0, 3, 1],
        [0, 7, 2],
        [1, 2, 1],
        [1, 3, 2],
        [1, 6, 2],
        [2, 3, 2],
        [2, 5, 1],
        [3, 4, 1],
        [4, 5, 2],
        [4, 6, 2],
        [4, 7, 1],
        [5, 6, 1],
        [5, 7, 2],
        [6, 7, 1],
    ]
    assert [g.numa_node for g in topo.gpus] == [0] * 4 + [1] * 4
    assert [g.cpu_affinity for g in topo.gpus] == ["0-23,48-71"] * 4 + ["24-47,72-95"] * 4
    assert [(n.name, [lv.name for lv in n.levels]) for n in topo.nics] == [
        ("mlx5_0", ["NODE", "NODE", "PIX", "PIX", "SYS", "SYS", "SYS", "SYS"]),
        ("mlx5_1", ["SYS", "SYS", "SYS", "SYS", "NODE", "NODE", "PIX", "PIX"]),
    ]


# ------------------------------------------------------------------------- variants
def test_legacy_output_with_soc_indented_rows_and_a_header_named_nic():
    topo = read("variant-legacy-soc-indented-header-nic-no-numa.txt")
    assert topo.gpu_count == 4
    assert topo.link(0, 1).pcie is PcieLevel.PIX
    assert topo.link(0, 2).pcie is PcieLevel.SYS  # SOC
    assert [(n.name, [lv.name for lv in n.levels]) for n in topo.nics] == [
        ("mlx5_0", ["PHB", "PHB", "SYS", "SYS"])
    ]
    assert all(g.numa_node is None for g in topo.gpus)
    assert [g.cpu_affinity for g in topo.gpus] == ["0-13,28-41"] * 2 + ["14-27,42-55"] * 2


def test_one_gpu_machine():
    topo = read("variant-1gpu-tabs.txt")
    assert topo.gpu_count == 1 and topo.links == ()
    assert (topo.gpus[0].numa_node, topo.gpus[0].cpu_affinity) == (0, "0-15")
    assert topo.nvlink_islands == ()


def test_real_output_whose_header_nvidia_smi_underlined():
    """Read on a lent H200 VM (driver 580.159.04): nvidia-smi wraps the header line in
    ESC[4m ... ESC[0m even into a pipe; the reader took that line for a row before."""
    path = FIXTURES / "h200-1gpu-vm-ansi-header.txt"
    assert b"\x1b[4mGPU0" in path.read_bytes()
    topo = read("h200-1gpu-vm-ansi-header.txt")
    assert topo.gpu_count == 1 and topo.links == () and topo.nics == ()
    assert (topo.gpus[0].numa_node, topo.gpus[0].cpu_affinity) == (0, "0-15")


def test_sixteen_gpus_on_nvswitch_with_eight_legend_nics():
    topo = read("variant-16gpu-nvswitch-tabs.txt")
    assert topo.gpu_count == 16
    assert all(link.nvlinks == 6 for link in topo.links) and len(topo.links) == 120
    assert topo.nvlink_cliques == (tuple(range(16)),)
    assert [n.name for n in topo.nics] == [f"mlx5_{k}" for k in range(8)]
    assert topo.nics[7].levels[14] is PcieLevel.PIX
    assert topo.numa_groups == {0: tuple(range(8)), 1: tuple(range(8, 16))}
    assert any("NODE for 56 pairs; SYS for 64 pairs" in note for note in topo.notes)


def test_empty_and_na_cells_are_unknown_and_the_other_row_fills_in():
    topo = read("variant-empty-cells-tabs.txt")
    assert topo.link(0, 1).pcie is None and topo.link(0, 1).nvlinks == 0
    assert topo.link(1, 2).pcie is None
    assert (topo.link(0, 2).nvlinks, topo.link(0, 2).pcie) == (2, PcieLevel.SYS)
    assert [g.numa_node for g in topo.gpus] == [0, None, 1]
    assert [g.cpu_affinity for g in topo.gpus] == ["0-7", "8-15", None]
    assert topo.nics[0].name == "mlx5_0"
    # GPU2's cell under NIC0 is empty: the NIC0 row says NODE
    assert topo.nics[0].levels == (PcieLevel.PIX, PcieLevel.SYS, PcieLevel.NODE)
    assert any("GPU2=3" in note for note in topo.notes)
    assert any("unknown" in note and "0-1 1-2" in note for note in topo.notes)


def test_an_empty_cell_in_space_aligned_text_is_found_from_the_tab_stops():
    topo = read("variant-empty-cells-aligned.txt")
    assert topo.link(0, 1).pcie is None
    assert topo.link(0, 2).pcie is PcieLevel.SYS
    assert (topo.link(0, 3).nvlinks, topo.link(0, 3).pcie) == (4, PcieLevel.SYS)
    assert [g.numa_node for g in topo.gpus] == [0, 0, 1, 1]


@pytest.mark.parametrize("expand", [False, True], ids=["tabs", "terminal-expanded"])
def test_empty_last_cells_that_lost_their_whitespace_are_empty_cells(expand):
    lines = ["\tGPU0\tGPU1\tNIC0", "GPU0\t X \tNV2", "GPU1\tNV2\t X \tPHB", "NIC0\t\tPHB\t X "]
    text = "\n".join(line.expandtabs(8) if expand else line for line in lines) + "\n"
    topo = parse_topo_matrix(text)
    assert topo.link(0, 1).nvlinks == 2
    assert topo.nics[0].levels == (None, PcieLevel.PHB)


def test_crlf_text_with_the_shell_prompt_pasted_around_it():
    topo = read("variant-crlf-with-prompt.txt")
    assert topo.gpu_count == 2
    assert (topo.link(0, 1).nvlinks, topo.link(0, 1).pcie) == (4, PcieLevel.NODE)


def test_columns_squeezed_to_single_spaces():
    topo = read("variant-single-spaces.txt")
    assert nvlinked(topo) == [[0, 1, 1], [0, 2, 1], [0, 3, 2], [1, 2, 2], [1, 3, 1], [2, 3, 2]]
    assert [g.numa_node for g in topo.gpus] == [0, 0, 1, 1]
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1"]
    assert topo.nics[1].levels == (PcieLevel.SYS, PcieLevel.SYS, PcieLevel.PXB, None)
    assert not any("NIC Legend" in note for note in topo.notes)


def test_nic_columns_without_a_legend_keep_their_header_names_and_say_so():
    text = "\tGPU0\tNIC0\tCPU Affinity\nGPU0\t X \tPIX\t0-7\nNIC0\tPIX\t X \n"
    topo = parse_topo_matrix(text)
    assert topo.nics[0].name == "NIC0"
    assert any("no NIC Legend entry for NIC0" in note for note in topo.notes)
    assert topo.source == "topo-matrix:<text>"


def test_the_matrix_ends_at_the_legend_or_a_non_row_line_and_what_follows_is_ignored():
    rows = "\tGPU0\tGPU1\nGPU0\t X \tNV1\nGPU1\tNV1\t X \n"
    after_legend = parse_topo_matrix(rows + "Legend:\n  X = Self\nGPU7 what\nNIC0 = ?\n")
    after_prompt = parse_topo_matrix(rows + "user@host:~$ exit\nGPU1 is idle\n")
    assert after_legend.links == after_prompt.links == parse_topo_matrix(rows).links
    assert after_legend.link(0, 1).nvlinks == 1


def test_lower_case_levels_and_padded_cells_are_read():
    topo = parse_topo_matrix("  GPU0  GPU1\nGPU0  x  nv2\nGPU1  Nv2  X\n")
    assert topo.link(0, 1).nvlinks == 2


# ---------------------------------------------------------------------------- errors
H = "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
ERROR_CASES = [
    (H + "GPU0\t X \tFOO\t0-7\t0\nGPU1\tSYS\t X \t0-7\t0\n", 2, "'FOO' under GPU1"),
    (H + "GPU0\t X \tX\t0-7\t0\nGPU1\tSYS\t X \t0-7\t0\n", 2, "X (self) under GPU1"),
    (H + "GPU0\tSYS\tSYS\t0-7\t0\nGPU1\tSYS\t X \t0-7\t0\n", 2, "own column"),
    (H + "GPU0\t X \tSYS\t0-7\t0\n", None, "no row for GPU1"),
    (H + "GPU0\t X \tSYS\t0-7\t0\nGPU0\t X \tSYS\t0-7\t0\n", 3, "second row for GPU0"),
    (H + "GPU0\t X \tNV2\t0-7\t0\nGPU1\tNV4\t X \t0-7\t0\n", 3, "not symmetric"),
    (H + "GPU0\t X \tSYS\tzero\t0\nGPU1\tSYS\t X \t0-7\t0\n", 2, "CPU Affinity 'zero'"),
    (H + "GPU0\t X \tSYS\t0-7\t0\nGPU1\tSYS\t X \t0-7\tone\n", 3, "NUMA Affinity 'one'"),
    (H + "GPU0\t X \tSYS\t0-7\t0\t5\nGPU1\tSYS\t X \t0-7\t0\n", 2, "values after the matrix"),
    (H + "GPU0\t X \tSYS\t0-7\t0\nGPU1\tSYS\t X \t0-7\t0\nGPU2\tSYS\tSYS\n", 4, "not a column"),
    ("no matrix here\n", None, "no `nvidia-smi topo -m` header"),
    ("", None, "no `nvidia-smi topo -m` header"),
    ("GPU0\t X \tSYS\n" + H, 1, "before the header"),
    ("\tGPU0\tGPU2\nGPU0\t X \tSYS\n", 1, "GPU0, GPU1, ... in order"),
    ("\tGPU0\tmlx5_0\tGPU1\n", 1, "comes after a non-GPU column"),
    ("\tGPU0\tGPU1\tGPU1\n", 1, "GPU columns must be"),
    (H + "GPU0 X\nGPU1\tSYS\t X \t0-7\t0\n", 2, "row GPU0 has 1 cells, expected 2"),
    ("\tGPU0\tGPU1\tNIC0\nGPU0\t X \tSYS\tNV1\nGPU1\tSYS\t X \tPIX\n", 2, "NVLinks to NIC0"),
    (H + "GPU0\t X \tSYS\t0-7\t0\nGPU1\tSYS\t X \t0-7\t0\n\nNIC Legend:\n", None, None),  # fine
]


@pytest.mark.parametrize("text, line, words", ERROR_CASES)
def test_unreadable_text_is_one_clear_error_naming_the_line(text, line, words):
    if words is None:
        parse_topo_matrix(text)
        return
    with pytest.raises(TopoMatrixError) as info:
        parse_topo_matrix(text, source="paste.txt")
    err = info.value
    message = str(err)
    assert words in message
    assert "\n" not in message
    assert message.startswith("paste.txt: ")
    assert err.line == line
    if line is not None:
        assert message.startswith(f"paste.txt: line {line}: ")


def test_topo_matrix_errors_are_input_errors_with_exit_code_2():
    with pytest.raises(InputFormatError) as info:
        parse_topo_matrix("garbage")
    assert info.value.exit_code == 2


def test_a_missing_file_is_a_topo_matrix_error(tmp_path):
    with pytest.raises(TopoMatrixError, match="cannot read the file"):
        read_topo_matrix(tmp_path / "nope.txt")


def test_a_binary_file_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "bin.txt"
    path.write_bytes(b"\tGPU0\nGPU0\t X \n\xff\xfe\n")
    with pytest.raises(TopoMatrixError, match="line 3: not UTF-8"):
        read_topo_matrix(path)


# ------------------------------------------------------------------- property tests
LEVELS = ["BOARD", "PIX", "PXB", "PHB", "NODE", "SYS", "SOC"]


@dataclass
class Truth:
    n: int
    cells: dict[tuple[int, int], str]  # GPU pair (a < b) -> printed cell
    numa: list[str | None]  # printed NUMA Affinity, None = unknown
    cpu: list[str | None]
    gnid: list[int | None]
    nic_names: list[str]  # names the topology must report
    nic_cells: list[list[str]]  # [nic][gpu] printed cell
    trailing: list[str]  # header trailing columns
    text: str = ""


def _unknown(cell: str) -> bool:
    return cell.strip().upper() in ("", "N/A")


@st.composite
def cpulists(draw, base: int) -> str:
    parts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 8)), min_size=1, max_size=3))
    out = []
    for lo, width in parts:
        lo += base
        out.append(str(lo) if width == 0 else f"{lo}-{lo + width}")
    return ",".join(out)


@st.composite
def matrices(draw) -> Truth:
    """A valid matrix and what it says, printed in one of the layouts real machines use."""
    n = draw(st.integers(1, 16))
    style = draw(st.sampled_from(["tabs", "aligned", "spaces"]))
    blank = "" if style != "spaces" else "N/A"  # squeezed text cannot show an empty cell
    unknown = st.sampled_from(["N/A", blank])
    trailing = draw(
        st.sampled_from(
            [
                [],
                ["CPU Affinity"],
                ["CPU Affinity", "NUMA Affinity"],
                ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"],
            ]
        )
    )
    cell = st.one_of(
        st.integers(1, 18).map(lambda k: f"NV{k}"),
        st.sampled_from(LEVELS),
        unknown,
    )
    cells = {(a, b): draw(cell) for a in range(n) for b in range(a + 1, n)}
    sockets = [draw(st.integers(0, 3)) for _ in range(n)]
    cpu = [draw(st.one_of(st.none(), st.just(f"{s * 24}-{s * 24 + 23}"))) for s in sockets]
    numa = [draw(st.one_of(st.none(), st.just(str(s)), cpulists(s))) for s in sockets]
    gnid = [draw(st.one_of(st.none(), st.integers(0, 40))) for _ in range(n)]
    k = draw(st.integers(0, 4))
    nic_style = draw(st.sampled_from(["header", "legend", "bare"]))
    header_nics = [f"mlx5_{j}" if nic_style == "header" else f"NIC{j}" for j in range(k)]
    nic_names = [f"mlx5_{j}" if nic_style != "bare" else f"NIC{j}" for j in range(k)]
    level_or_unknown = st.one_of(st.sampled_from(LEVELS), unknown)
    nic_cells = [[draw(level_or_unknown) for _ in range(n)] for _ in range(k)]
    nic_nic = {(x, y): draw(st.sampled_from(LEVELS)) for x in range(k) for y in range(x + 1, k)}
    with_nic_rows = draw(st.booleans())
    truth = Truth(
        n,
        cells,
        numa if "NUMA Affinity" in trailing else [None] * n,
        cpu if trailing else [None] * n,
        gnid if "GPU NUMA ID" in trailing else [None] * n,
        nic_names,
        nic_cells,
        trailing,
    )

    def gpu_gpu(a: int, b: int) -> str:
        return " X " if a == b else cells[(min(a, b), max(a, b))]

    def nic_nic_cell(x: int, y: int) -> str:
        return " X " if x == y else nic_nic[(min(x, y), max(x, y))]

    columns = [f"GPU{i}" for i in range(n)] + header_nics
    table: list[list[str]] = [[""] + columns + trailing]
    for i in range(n):
        row = [f"GPU{i}"] + [gpu_gpu(i, j) for j in range(n)] + [nic_cells[x][i] for x in range(k)]
        values = []
        for name in trailing:
            if name == "CPU Affinity":
                values.append(cpu[i] if cpu[i] is not None else draw(unknown))
            elif name == "NUMA Affinity":
                values.append(numa[i] if numa[i] is not None else draw(unknown))
            else:
                values.append(str(gnid[i]) if gnid[i] is not None else draw(unknown))
        if style == "spaces":
            values = [v or "N/A" for v in values]  # an empty value cannot be placed
        elif "GPU NUMA ID" in trailing and draw(st.booleans()):
            values.insert(2, "")  # nvidia-smi's extra empty cell before GPU NUMA ID
        table.append(row + values)
    if with_nic_rows:
        for x in range(k):
            row = [header_nics[x]] + [nic_cells[x][i] for i in range(n)]
            row += [nic_nic_cell(x, y) for y in range(k)]
            if style == "tabs" and draw(st.booleans()):
                row += [""] * len(trailing)  # nvidia-smi pads NIC rows with empty cells
            table.append(row)

    if style == "tabs":
        indent = draw(st.sampled_from(["", " ", "\t", "  "]))
        lines = ["\t".join(table[0])] + [indent + "\t".join(r) for r in table[1:]]
        if draw(st.booleans()):  # an editor that strips trailing whitespace
            lines = [line.rstrip() for line in lines]
    elif style == "aligned":  # what a terminal shows: tabs expanded to 8-column stops
        indent = draw(st.sampled_from(["", "  ", "    "]))
        lines = ["\t".join(table[0]).expandtabs(8)]
        lines += [(indent + "\t".join(r).expandtabs(8)).rstrip() for r in table[1:]]
    else:
        seps = st.sampled_from([" ", "  ", "   ", "\t "])
        lines = []
        for r in table:
            cells_ = [c.strip() for c in r if c.strip()]  # the empty corner cell vanishes
            text_ = ""
            for c_i, c in enumerate(cells_):
                text_ += (draw(seps) if c_i else draw(st.sampled_from(["", " ", "  "]))) + c
            lines.append(text_)
    text = "\n".join(lines) + "\n"
    if k and nic_style == "legend":
        text += "\nLegend:\n\n  X    = Self\n\nNIC Legend:\n\n"
        text += "".join(f"  NIC{j}: mlx5_{j}\n" for j in range(k))
    truth.text = text
    return truth


def _expected_level(truth: Truth, a: int, b: int) -> tuple[int, PcieLevel | None]:
    printed = truth.cells[(a, b)]
    if _unknown(printed):
        return 0, None
    if printed.startswith("NV"):
        na, nb = truth.numa[a], truth.numa[b]
        lowest = [
            None if x is None else min(int(p.split("-")[0]) for p in x.split(",")) for x in (na, nb)
        ]
        if lowest[0] is not None and lowest[1] is not None:
            same = lowest[0] == lowest[1]
        elif lowest[0] is None and lowest[1] is None:
            same = truth.cpu[a] is not None and truth.cpu[a] == truth.cpu[b]
        else:
            same = False
        return int(printed[2:]), PcieLevel.NODE if same else PcieLevel.SYS
    return 0, PcieLevel.SYS if printed == "SOC" else PcieLevel[printed]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(matrices())
def test_any_valid_matrix_in_any_layout_parses_to_what_it_says(truth):
    topo = parse_topo_matrix(truth.text)
    assert topo.gpu_count == truth.n
    for a, b in itertools.combinations(range(truth.n), 2):
        link = topo.link(a, b)
        assert (link.nvlinks, link.pcie) == _expected_level(truth, a, b), (a, b)
    for i, gpu in enumerate(topo.gpus):
        want_numa = truth.numa[i]
        assert gpu.numa_node == (
            None if want_numa is None else min(int(p.split("-")[0]) for p in want_numa.split(","))
        )
        assert gpu.cpu_affinity == truth.cpu[i]
    gnids = [f"GPU{i}={g}" for i, g in enumerate(truth.gnid) if g is not None]
    if gnids:
        assert any(note.endswith(", ".join(gnids)) for note in topo.notes)
    assert [nic.name for nic in topo.nics] == truth.nic_names
    for nic, cells in zip(topo.nics, truth.nic_cells, strict=True):
        assert nic.levels == tuple(None if _unknown(c) else PcieLevel.parse(c) for c in cells)


def _mutations():
    texts = [p.read_text() for p in sorted(FIXTURES.glob("*.txt"))][:8]
    junk = st.sampled_from(
        [
            "X",
            " X ",
            "NV",
            "NV0",
            "NV12",
            "SYS",
            "N/A",
            "GPU0",
            "GPU1",
            "GPU99",
            "NIC0",
            "mlx5_0",
            "\t",
            "  ",
            "\n",
            "\r",
            ":",
            "-",
            ",",
            "0-7",
            "9-3",
            "Legend:",
            "NIC Legend:",
            "CPU Affinity",
            "NUMA Affinity",
            "GPU NUMA ID",
            "\x00",
            "é",
            "99999999999999999999",
        ]
    )

    @st.composite
    def mutated(draw) -> str:
        text = draw(st.sampled_from(texts))
        for _ in range(draw(st.integers(1, 6))):
            op = draw(st.sampled_from(["delete", "insert", "swap_lines", "dup_line", "truncate"]))
            if not text:
                break
            pos = draw(st.integers(0, len(text) - 1))
            if op == "delete":
                text = text[:pos] + text[pos + draw(st.integers(1, 12)) :]
            elif op == "insert":
                text = text[:pos] + draw(junk) + text[pos:]
            elif op == "truncate":
                text = text[:pos]
            else:
                lines = text.split("\n")
                i = draw(st.integers(0, len(lines) - 1))
                j = draw(st.integers(0, len(lines) - 1))
                if op == "swap_lines":
                    lines[i], lines[j] = lines[j], lines[i]
                else:
                    lines.insert(j, lines[i])
                text = "\n".join(lines)
        return text

    # mostly near-misses of real output, which reach deep into the reader
    return st.one_of(
        mutated(),
        mutated(),
        mutated(),
        st.text(max_size=200),
        st.lists(junk, max_size=40).map("".join),
    )


@settings(max_examples=300, deadline=None)
@given(_mutations())
def test_mangled_text_either_parses_or_raises_one_topo_matrix_error(text):
    try:
        topo = parse_topo_matrix(text)
    except TopoMatrixError as err:
        assert "\n" not in str(err)
        return
    assert topo.gpu_count >= 1


def test_grace_matrix_keeps_the_numa_node_list_and_the_gpu_memory_node_on_each_gpu():
    topo = read_topo_matrix(FIXTURES / "gb200-4gpu-8nic.txt")
    assert [g.numa_node for g in topo.gpus] == [0, 0, 1, 1]
    assert [g.numa_affinity for g in topo.gpus] == ["0,3-9,11-17"] * 2 + ["1,19-25,27-33"] * 2
    assert [g.memory_numa_node for g in topo.gpus] == [2, 10, 18, 26]


def test_single_node_numa_affinity_is_kept_verbatim_and_no_gpu_numa_id_means_none():
    topo = read_topo_matrix(FIXTURES / "l40s-4gpu-2socket-2nic.txt")
    assert [g.numa_affinity for g in topo.gpus] == ["0", "0", "1", "1"]
    assert all(g.memory_numa_node is None for g in topo.gpus)
