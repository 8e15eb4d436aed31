"""NCCL topology files as a topology source: the three Azure VM files of
``tests/fixtures/nccl/`` (copied from ``../shared/data/nccl/``, Azure/azhpc-images) read through
``--simulate FILE`` and standard input, every malformed case NCCL refuses, and the overlay
of a file on the GPUs NVML sees (matched by bus ID)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent import cli
from agent.discovery import load_topology

NCCL = Path(__file__).parent / "fixtures" / "nccl"


def discover_json(capsys, machine: str) -> dict:
    rc = cli.main(["discover", "--simulate", machine, "--format", "json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def pair_levels(doc: dict) -> dict[tuple[int, int], str]:
    return {(k["a"], k["b"]): k["pcie"] for k in doc["links"]}


def test_ndv5_gives_eight_gpus_two_numa_nodes_and_one_nic_per_switch(capsys):
    doc = discover_json(capsys, str(NCCL / "azure-ndv5-h100.xml"))
    buses = [g["pci_bus_id"] for g in doc["gpus"]]
    assert buses == [f"0000000{d}:00:00.0" for d in "123089ABC"[:3]] + [
        "00000008:00:00.0", "00000009:00:00.0", "0000000A:00:00.0", "0000000B:00:00.0", "0000000C:00:00.0",
    ]
    assert [g["numa_node"] for g in doc["gpus"]] == [0] * 4 + [1] * 4
    levels = pair_levels(doc)
    assert levels[(0, 1)] == "NODE" and levels[(3, 4)] == "SYS"  # one switch per GPU
    # each virtual switch ffff:ff:0N.0 pairs one GPU with one InfiniBand NIC
    assert [n["name"] for n in doc["nics"]] == [f"nic-010{k}-00-00.0" for k in range(1, 9)]
    for k, nic in enumerate(doc["nics"]):
        assert [i for i, lv in enumerate(nic["levels"]) if lv == "PIX"] == [k]
        assert nic["numa_node"] == (0 if k < 4 else 1)
        assert nic["levels"].count("SYS") == 4


def test_ndv2_gives_two_numa_nodes_no_switches_and_one_nic_on_numa_0(capsys):
    doc = discover_json(capsys, str(NCCL / "azure-ndv2-v100.xml"))
    assert [g["pci_bus_id"] for g in doc["gpus"]] == [f"0000000{k}:00:00.0" for k in range(1, 9)]
    assert [g["numa_node"] for g in doc["gpus"]] == [0] * 4 + [1] * 4
    assert set(pair_levels(doc).values()) == {"NODE", "SYS"}  # no PCIe switch in the file
    (nic,) = doc["nics"]
    assert nic["pci_bus_id"] == "0101:00:00.0" and nic["numa_node"] == 0
    assert nic["levels"] == ["NODE"] * 4 + ["SYS"] * 4


def test_ncv4_full_dump_form_gives_four_numa_nodes_and_the_ethernet_net(capsys):
    doc = discover_json(capsys, str(NCCL / "azure-ncv4-a100.xml"))
    assert [g["numa_node"] for g in doc["gpus"]] == [0, 1, 2, 3]
    assert set(pair_levels(doc).values()) == {"SYS"}
    assert all(k["nvlinks"] == 0 for k in doc["links"])  # its <nvlink>s point at the GPU itself
    (nic,) = doc["nics"]
    assert nic["name"] == "eth0" and nic["numa_node"] == 0
    assert nic["levels"] == ["NODE", "SYS", "SYS", "SYS"]
    topo = load_topology(str(NCCL / "azure-ncv4-a100.xml"))
    assert {g.compute_capability for g in topo.gpus} == {(8, 0)}  # <gpu sm="80">
    assert topo.numa_cpulists == {0: "0-23", 1: "24-47", 2: "48-71", 3: "72-95"}
    assert any("names no other GPU" in n for n in topo.notes)


def test_switch_hierarchy_and_nvlinks_of_a_dump(tmp_path, capsys):
    xml = tmp_path / "node.xml"
    xml.write_text(
        '<system version="1">\n'
        ' <cpu numaid="0" affinity="0000ffff" arch="x86_64">\n'
        '  <pci busid="0000:10:00.0" class="0x060400" link_speed="32.0 GT/s PCIe" link_width="16">\n'
        '   <pci busid="0000:11:00.0" class="0x060400" link_speed="" link_width="0">\n'
        '    <pci busid="0000:12:00.0" class="0x030200">\n'
        '     <gpu sm="90"><nvlink target="0000:13:00.0" count="4" tclass="0x030200"/>'
        '<nvlink target="fffffff:ffff:ff" count="18" tclass="0x068000"/></gpu>\n'
        '    </pci>\n'
        '    <pci busid="0000:13:00.0" class="0x030200"><gpu sm="90">'
        '<nvlink target="0000:12:00.0" count="4" tclass="0x030200"/></gpu></pci>\n'
        '   </pci>\n'
        '   <pci busid="0000:14:00.0" class="0x030200"><gpu><nvlink target="0000:15:00.0" count="18" '
        'tclass="0x068000"/></gpu></pci>\n'
        '   <pci busid="0000:16:00.0" class="0x020700"/>\n'
        '  </pci>\n'
        '  <nic><net name="mlx5_9" dev="0"/></nic>\n'
        ' </cpu>\n'
        '</system>\n'
    )
    topo = load_topology(str(xml))
    assert topo.link(0, 1).pcie.name == "PIX" and topo.link(0, 2).pcie.name == "PXB"
    assert topo.link(0, 1).nvlinks == 4  # direct pair
    assert topo.link(0, 2).nvlinks == 18 and topo.link(1, 2).nvlinks == 0  # through NVSwitches
    nics = {n.name: [lv.name if lv else None for lv in n.levels] for n in topo.nics}
    assert nics["nic-0000-16-00.0"] == ["PXB", "PXB", "PIX"]
    assert nics["mlx5_9"] == ["NODE", "NODE", "NODE"]


def test_standard_input_is_read_as_an_nccl_file_too(monkeypatch, capsys):
    from test_cli_errors import run_cli

    proc = run_cli("discover", "--simulate", "-", "--format", "json",
                   stdin=(NCCL / "azure-ndv2-v100.xml").read_bytes())
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["gpus"]) == 8


@pytest.mark.parametrize("command", ["labels", "allocate --size 2", "slices --node-name n1"])
def test_every_subcommand_takes_an_nccl_file(command, capsys):
    rc = cli.main([*command.split(), "--simulate", str(NCCL / "azure-ndv5-h100.xml")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out


GOOD = '<system version="1">\n <cpu numaid="0">\n  <pci busid="0000:01:00.0" class="0x030200"/>\n </cpu>\n</system>\n'

MALFORMED = [
    # (text, line, what the message says)
    ('<?xml version="1.0"?>\n' + GOOD, 1, "expected '>'"),
    ("<topology>\n <gpu/>\n</topology>\n", 1, "no <system> element"),
    ('<system version="2">\n</system>\n', 1, 'version="1"'),
    ("<system>\n</system>\n", 1, 'version="1"'),
    (GOOD.replace("<cpu", "\t<cpu"), 2, "expected '<'"),
    (GOOD.replace('busid="0000:01:00.0"', "busid=0000:01:00.0"), 3, "quoted value"),
    (GOOD.replace(' class="0x030200"', '\n class="0x030200"'), 3, "one line"),
    (GOOD.replace("</cpu>", "</pci>"), 4, "closes <cpu>"),
    (GOOD.replace(" </cpu>\n</system>\n", ""), 4, "unterminated <cpu> (opened on line 2)"),
    (GOOD.replace('busid="0000:01:00.0"', 'busid="' + "a" * 254 + '"'), 3, "longer than 253"),
    (GOOD.replace(' numaid="0"', ""), 2, "numaid"),
    (GOOD.replace(' class="0x030200"', ""), 3, "needs class"),
    (GOOD.replace("0000:01:00.0", "pci-01"), 3, "expected a PCI bus ID"),
    (GOOD.replace("<pci", "<!-- open"), 3, "unterminated comment"),
    (GOOD + "</system>\n", 6, "no open element"),
    (GOOD.replace('"/>', '"/>\n  <pci busid="0000:01:00.0" class="0x020700"/>'), 4, "appears twice"),
    ('<system version="1">\n some text\n</system>\n', 2, "expected '<'"),
]


@pytest.mark.parametrize("text,line,says", MALFORMED, ids=[m[2] for m in MALFORMED])
def test_malformed_file_exits_2_with_one_line_naming_file_and_line(tmp_path, capsys, text, line, says):
    path = tmp_path / "bad.xml"
    path.write_text(text)
    rc = cli.main(["discover", "--simulate", str(path)])
    _, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert f"{path}: line {line}: " in lines[0] and says in lines[0], lines[0]


def test_nccl_limits_children_and_elements(tmp_path, capsys):
    many = "".join(f'<pci busid="0000:{i // 32:02x}:{i % 32:02x}.0" class="0x030200"/>\n' for i in range(257))
    path = tmp_path / "big.xml"
    path.write_text(f'<system version="1">\n<cpu numaid="0">\n{many}</cpu>\n</system>\n')
    rc = cli.main(["discover", "--simulate", str(path)])
    _, err = capsys.readouterr()
    assert rc == 2 and "more than 256 elements" in err and ": line 257: " in err


def test_unknown_elements_are_ignored_as_nccl_ignores_them(tmp_path):
    path = tmp_path / "extra.xml"
    path.write_text(GOOD.replace("</cpu>", ' <vendor-extension a="1"><x/></vendor-extension>\n </cpu>'))
    topo = load_topology(str(path))
    assert len(topo.gpus) == 1
    assert any("<vendor-extension> on line 4 ignored" in n for n in topo.notes)


# ----------------------------------------------------------------------------- on a node
PCIE_4GPU_FILE = (
    '<system version="1">\n'
    ' <cpu numaid="1" affinity="0000ffff" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="85">\n'
    '  <pci busid="ffff:ff:01.0" class="0x060400" link_speed="16.0 GT/s PCIe" link_width="16">\n'
    '   <pci busid="0000:01:00.0" class="0x030200" link_speed="16.0 GT/s PCIe" link_width="16"/>\n'
    '   <pci busid="0000:41:00.0" class="0x030200" link_speed="16.0 GT/s PCIe" link_width="16"/>\n'
    '   <pci busid="0000:c1:00.0" class="0x020700" link_speed="16.0 GT/s PCIe" link_width="16"/>\n'
    '  </pci>\n'
    ' </cpu>\n'
    ' <cpu numaid="0" affinity="ffff0000">\n'
    '  <pci busid="0000:81:00.0" class="0x030200"/>\n'
    '  <pci busid="0000:a1:00.0" class="0x030200"/>\n'
    ' </cpu>\n'
    '</system>\n'
)


def node_topology(machine: str, nccl_file: str):
    from agent.discovery import open_backend, read_topology

    backend, sim = open_backend(machine)
    backend.init()
    try:
        return read_topology(backend, sim, nccl_file)
    finally:
        backend.shutdown()
        sim.close()


def test_a_file_lays_its_placement_over_nvmls_gpus_matched_by_bus_id(tmp_path):
    path = tmp_path / "vm.xml"
    path.write_text(PCIE_4GPU_FILE)
    plain = load_topology("pcie-4gpu")
    topo = node_topology("pcie-4gpu", str(path))
    assert [g.uuid for g in topo.gpus] == [g.uuid for g in plain.gpus]  # NVML's GPUs
    assert [g.numa_node for g in topo.gpus] == [1, 1, 0, 0]  # the file's placement
    assert topo.link(0, 1).pcie.name == "PIX" and topo.link(0, 2).pcie.name == "SYS"
    (nic,) = topo.nics  # the file's NIC, named as sysfs names it
    assert nic.name == "mlx5_0" and [lv.name for lv in nic.levels] == ["PIX", "PIX", "SYS", "SYS"]
    assert any("NCCL topology file" in n for n in topo.notes)


def test_run_refuses_a_file_of_other_gpus_naming_the_bus_ids(tmp_path):
    from test_cli_errors import one_error_line, run_cli

    path = tmp_path / "other.xml"
    path.write_text(PCIE_4GPU_FILE.replace("0000:a1:00.0", "0000:b1:00.0"))
    proc = run_cli("run", "--simulate", "pcie-4gpu", "--nccl-topology-file", str(path),
                   "--kubelet-dir", str(tmp_path / "k"), "--features-dir", str(tmp_path / "f"),
                   "--metrics-address", "127.0.0.1:0", "--log-level", "ERROR")
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert str(path) in line and "missing from the file: 0000:a1:00.0" in line and "does not see: 0000:b1:00.0" in line


def test_the_setting_is_a_config_field_an_env_variable_and_a_flag(tmp_path):
    from agent.config import load_config

    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: v1\ntopology:\n  ncclTopologyFile: /etc/vm.xml\nnccl:\n  topologyFile: 'off'\n"
                   "  mountPath: /opt/nccl.xml\n  setIbHca: true\n")
    config = load_config(str(cfg), {}, {})
    assert (config.nccl_topology_file, config.nccl_pod_files, config.nccl_mount_path, config.nccl_ib_hca) == (
        "/etc/vm.xml", "off", "/opt/nccl.xml", True)
    assert load_config(str(cfg), {"NCCL_TOPOLOGY_FILE": "/a.xml"}, {}).nccl_topology_file == "/a.xml"
    assert load_config(str(cfg), {"NCCL_TOPOLOGY_FILE": "/a.xml"}, {"nccl_topology_file": "/b.xml"}).nccl_topology_file == "/b.xml"
    cfg.write_text("version: v1\nnccl:\n  topologyFile: sometimes\n")
    from agent.errors import ConfigError

    with pytest.raises(ConfigError, match=r"nccl.topologyFile.*auto.*off"):
        load_config(str(cfg), {}, {})
