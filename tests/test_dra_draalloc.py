"""The agent's slices through the scheduler's DRA allocator: they decode strictly and allocate
as the example claims say.

Each allocation test body runs against two backends (the ``allocator`` fixture):

- ``model``: ``tests/testbed/dra_allocator_model.py``, the Python model of the allocator, over the
  ``resource.k8s.io/v1`` objects (slices, the shipped classes, the claim templates as written),
  everywhere (CI included);
- ``draalloc``: the scheduler's own allocator (Kubernetes v1.32, v1beta1 objects) in
  ``$GPU_AGENT_K8S_BINARIES``; skips, saying why, where it is unset.
"""

from __future__ import annotations

import copy
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from k8s_binaries import k8s_binary, missing_reason

from agent.discovery import load_topology
from agent.dra.slices import SETS_API_VERSIONS, render_slices
from agent.dra.yaml_stream import dump_yaml
from agent.hw.sim.machines import BUILTIN_MACHINES
from tests.testbed.dra_allocator_model import AllocatorModel
from tests.testbed.dra_shipped_classes import CEL

ROOT = Path(__file__).resolve().parents[1]
DRAALLOC = k8s_binary("draalloc")
EXAMPLES = ROOT / "daemonset" / "dra" / "examples" / "claim-templates.yaml"
CLASSES = ROOT / "daemonset" / "dra" / "deviceclass.yaml"
D = "gpu.gpu-agent.io"
#: The Kubernetes version draalloc is built from (k8s_binaries.py): it decodes its inputs
#: strictly, as that version's resource.k8s.io/v1beta1 types define them.
KUBE = "1.32.0"

BACKENDS = ("model", "draalloc")


@pytest.fixture(params=BACKENDS)
def allocator(request):
    """The allocator backend a test body runs against (module docstring)."""
    if request.param == "draalloc" and missing_reason("draalloc") is not None:
        pytest.skip(str(missing_reason("draalloc")))
    return request.param


def api_of(backend):
    """The resource.k8s.io version ``backend`` reads."""
    return "v1" if backend == "model" else "v1beta1"


def to_v1beta1(obj):
    """A v1 DeviceClass or claim spec in v1beta1 form (requests carry `exactly` inline)."""
    out = copy.deepcopy(obj)
    out["apiVersion"] = "resource.k8s.io/v1beta1"
    reqs = out.get("spec", {}).get("devices", {}).get("requests", [])
    for i, r in enumerate(reqs):
        reqs[i] = {"name": r["name"], **r.get("exactly", {})}
    return out


def template_claim(name, claim_name=None, api="v1beta1"):
    for doc in yaml.safe_load_all(EXAMPLES.read_text()):
        if doc["metadata"]["name"] == name:
            claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                     "metadata": {"name": claim_name or name, "namespace": "default"},
                     "spec": copy.deepcopy(doc["spec"]["spec"])}
            return claim if api == "v1" else to_v1beta1(claim)
    raise KeyError(name)


def request_of(claim, i=0):
    """The mapping holding request ``i``'s class, count and selectors (v1: under ``exactly``)."""
    req = claim["spec"]["devices"]["requests"][i]
    return req.get("exactly", req)


def selects_gpu_sets(device_class):
    return any('.type == "gpuset"' in sel["cel"]["expression"] for sel in device_class["spec"].get("selectors", ()))


def classes(api_version="v1beta1"):
    """The device classes the chart renders for a cluster whose newest ``resource.k8s.io`` is
    ``api_version`` (``daemonset/dra/deviceclass.yaml`` is its rendering for v1): the GPU and
    MIG classes in every version; the GPU-set classes (``gpuset.*``, ``set-of-k.*`` with
    ``extendedResourceName``, a v1.34+ field) only in the versions the agent publishes sets in
    (:data:`~agent.dra.slices.SETS_API_VERSIONS`, the chart's ``if eq $api
    "resource.k8s.io/v1"``): draalloc (v1.32, v1beta1) decodes strictly and refuses them."""
    v1 = list(yaml.safe_load_all(CLASSES.read_text()))
    kept = [c for c in v1 if api_version in SETS_API_VERSIONS or not selects_gpu_sets(c)]
    return kept if api_version == "v1" else [to_v1beta1(c) for c in kept]


def allocate(backend, tmp_path, slices, claims, allocated=(), extra_classes=(), cel=None):
    """Each claim allocated on node-1 alone: claim name -> ``{"allocated", "devices": [{"request",
    "device"}], "error"}`` (draalloc's output; the model's answer in the same shape). ``cel``:
    predicates for the expressions beyond the shipped classes' (the model runs no CEL)."""
    if backend == "model":
        return _model_allocate(slices, claims, allocated, extra_classes, cel or {})
    d = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    (d / "s.yaml").write_text(dump_yaml(slices))
    (d / "c.yaml").write_text(yaml.safe_dump_all([*classes(), *extra_classes]))
    (d / "q.yaml").write_text(yaml.safe_dump_all(claims))
    args = [str(DRAALLOC), "--slices", str(d / "s.yaml"), "--classes", str(d / "c.yaml"),
            "--claims", str(d / "q.yaml"), "--node", "node-1"]
    if allocated:
        args += ["--allocated", ",".join(f"{D}/node-1/{a}" for a in allocated)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return {c["claim"].split("/")[1]: c for c in json.loads(proc.stdout)["claims"]}


def _model_allocate(slices, claims, allocated, extra_classes, cel):
    model = AllocatorModel(slices, [*classes("v1"), *extra_classes], {**CEL, **cel},
                           allocated=[(D, "node-1", a) for a in allocated])
    out = {}
    for claim in claims:
        result = model.allocate([claim], "node-1")
        devices = [{"request": r, "device": dev[2]} for r, dev in (result or [[]])[0]]
        out[claim["metadata"]["name"]] = {"allocated": result is not None, "devices": devices,
                                          "error": "" if result is not None else "cannot allocate all claims"}
    return out


def indices(result):
    return [int(d["device"].split("-")[1]) for d in result["devices"]]


def slices_of(machine, api="v1beta1"):
    """``machine``'s slices in ``api``; in v1 without GPU sets, as the agent publishes them where
    sets are off (the sets' shared counters would bring in the model's v0.36 counter leak, a
    behaviour draalloc v1.32 cannot have: its v1beta1 has no counters)."""
    return render_slices(load_topology(machine), node_name="node-1", api_version=api, with_sets=False)


def nic_slice(topo, api="v1beta1"):
    """The RDMA NIC mlx5_5 of ``topo`` as another driver's device, beside the agent's slices."""
    (nic,) = [n for n in topo.nics if n.name == "mlx5_5"]
    attributes = {"resource.kubernetes.io/pcieRoot": {"string": nic.pcie_root}}
    device = {"name": "mlx5-5", **({"attributes": attributes} if api == "v1" else {"basic": {"attributes": attributes}})}
    return {
        "apiVersion": f"resource.k8s.io/{api}", "kind": "ResourceSlice",
        "metadata": {"name": "node-1-nic"},
        "spec": {"driver": "nic.example.com", "nodeName": "node-1",
                 "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
                 "devices": [device]},
    }


NIC_EXPR = 'device.driver == "nic.example.com"'


def nic_class(api="v1beta1"):
    return {"apiVersion": f"resource.k8s.io/{api}", "kind": "DeviceClass", "metadata": {"name": "rdma-nic"},
            "spec": {"selectors": [{"cel": {"expression": NIC_EXPR}}]}}


NIC_CLASS = nic_class()
CLAIMS = ("any-gpus", "gpus-one-nvlink-island", "gpus-one-numa-node", "gpu-with-rdma-nic")


def tier_inputs():
    """Every object the tests below write into draalloc's input files."""
    yield from classes()
    yield NIC_CLASS
    yield from (template_claim(name) for name in CLAIMS)
    for machine in BUILTIN_MACHINES:
        yield from slices_of(machine)
    yield nic_slice(load_topology("dgx-h100"))


def test_every_input_the_tier_hands_draalloc_is_valid_for_its_kubernetes_version():
    """Runs without draalloc: each input, validated strictly against Kubernetes 1.32's schemas
    (kubernetes-validate, strict: a field that version does not know is an error, as
    draalloc's strict decoding refuses it: ``json: unknown field``)."""
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (the test extra has it)")
    problems, checked = [], 0
    for obj in tier_inputs():
        checked += 1
        try:
            kubernetes_validate.validate(obj, KUBE, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{obj['kind']} {obj['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")
    assert checked > len(BUILTIN_MACHINES)
    assert not problems, "\n".join(problems)


def test_what_the_allocator_tests_hand_draalloc_still_exists():
    """Runs without draalloc, so that these tests cannot rot while they skip: the claim
    templates and classes they name, every machine's v1beta1 slices with devices named
    ``gpu-<index>`` (as :func:`indices` reads them), and the NIC the RDMA test pairs with."""
    assert {"gpu.gpu-agent.io", "mig.gpu.gpu-agent.io"} <= {c["metadata"]["name"] for c in classes()}
    sets = {c["metadata"]["name"] for c in classes("v1") if selects_gpu_sets(c)}
    assert {f"set-of-{k}.{D}" for k in (2, 4, 8)} <= sets  # what v1beta1 leaves out
    for name in CLAIMS:
        assert template_claim(name)["spec"]["devices"]["requests"], name
    for machine in BUILTIN_MACHINES:
        topo = load_topology(machine)
        names = [d["name"] for obj in slices_of(machine) for d in obj["spec"]["devices"]]
        assert yaml.safe_load_all(dump_yaml(slices_of(machine)))
        if not any(g.mig_enabled for g in topo.gpus):
            assert sorted(int(n.split("-")[1]) for n in names if n.startswith("gpu-")) == [
                g.index for g in topo.gpus
            ], (machine, names)
    dgx = load_topology("dgx-h100")
    assert [n.pcie_root for n in dgx.nics if n.name == "mlx5_5"] != [None]


def test_every_machines_slices_decode_strictly_and_allocate(allocator, tmp_path):
    def one(machine):
        topo = load_topology(machine)
        objs = slices_of(machine, api_of(allocator))
        mig = any(g.mig_enabled for g in topo.gpus)
        cls = "mig.gpu.gpu-agent.io" if mig else "gpu.gpu-agent.io"
        claim = template_claim("any-gpus", api=api_of(allocator))
        request_of(claim).update(deviceClassName=cls, count=1)
        return machine, allocate(allocator, tmp_path / machine, objs, [claim])

    for m in BUILTIN_MACHINES:
        (tmp_path / m).mkdir()
    with ThreadPoolExecutor(4) as pool:
        for machine, result in pool.map(one, BUILTIN_MACHINES):
            assert result["any-gpus"]["allocated"], (machine, result)


def test_island_constraint_keeps_a_claim_in_one_island(allocator, tmp_path):
    # pcie-pairs: islands {0,1} {2,3} {4,5} {6,7}; with GPU 1 taken, a 2-GPU island claim
    # must skip GPU 0 (alone in its island now) and take a whole pair
    api = api_of(allocator)
    claim = template_claim("gpus-one-nvlink-island", api=api)
    request_of(claim)["count"] = 2
    got = allocate(allocator, tmp_path, slices_of("pcie-pairs", api), [claim], allocated=["gpu-1"])
    assert got["gpus-one-nvlink-island"]["allocated"]
    assert sorted(indices(got["gpus-one-nvlink-island"])) == [2, 3]


def test_numa_selector_gets_gpus_of_that_node(allocator, tmp_path):
    api = api_of(allocator)
    claim = template_claim("any-gpus", "numa1", api=api)
    expr = f'device.attributes["{D}"].numaNode == 1'
    request_of(claim)["selectors"] = [{"cel": {"expression": expr}}]
    on_numa_1 = {expr: lambda d: d.attributes.get(D, {}).get("numaNode") == 1}
    got = allocate(allocator, tmp_path, slices_of("dgx-h100", api), [claim], cel=on_numa_1)
    assert sorted(indices(got["numa1"])) == [4, 5]


def test_numa_constraint_keeps_a_claim_on_one_numa_node(allocator, tmp_path):
    api = api_of(allocator)
    claim = template_claim("gpus-one-numa-node", api=api)
    got = allocate(allocator, tmp_path, slices_of("dgx-h100", api), [claim], allocated=["gpu-0", "gpu-1", "gpu-2"])
    assert sorted(indices(got["gpus-one-numa-node"])) == [4, 5]


def test_impossible_claim_is_reported_unschedulable(allocator, tmp_path):
    api = api_of(allocator)
    claim = template_claim("gpus-one-nvlink-island", api=api)  # 4 GPUs on one island: islands are pairs
    got = allocate(allocator, tmp_path, slices_of("pcie-pairs", api), [claim])
    assert got["gpus-one-nvlink-island"]["allocated"] is False
    assert got["gpus-one-nvlink-island"]["error"]


def test_gpu_aligned_with_an_rdma_nic_by_pcie_root(allocator, tmp_path):
    topo = load_topology("dgx-h100")
    api = api_of(allocator)
    got = allocate(allocator, tmp_path, [*slices_of("dgx-h100", api), nic_slice(topo, api)],
                   [template_claim("gpu-with-rdma-nic", api=api)], extra_classes=[nic_class(api)],
                   cel={NIC_EXPR: lambda d: d.driver == "nic.example.com"})
    result = got["gpu-with-rdma-nic"]
    assert result["allocated"], result
    gpu = [d["device"] for d in result["devices"] if d["request"] == "gpu"]
    mlx5_5 = next(n for n in topo.nics if n.name == "mlx5_5")
    assert topo.gpus[int(gpu[0].split("-")[1])].pcie_root == mlx5_5.pcie_root
