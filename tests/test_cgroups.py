"""A GPU process's cgroup names its container: every spelling the kubelet's two cgroup
drivers and the runtimes write, under cgroup v1, v2 and hybrid, read from real
``/proc/<pid>/cgroup`` texts; and the reader's faults (gone, unreadable) never raise."""

from __future__ import annotations

import logging
import os

import pytest

from agent.attribution.cgroups import CgroupOwner, CgroupReader, parse_cgroup

CID = "4f1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8"
UID = "5c1e3b2a-6f7d-4c8e-9a0b-1d2e3f4a5b6c"
UID_ = UID.replace("-", "_")
STATIC_UID = "8d2f2b7a5a1e4c6f9b0d3e1a2c4b6d8f"  # a static pod's UID: a hash, no dashes

# (case, /proc/<pid>/cgroup text, expected owner)
CASES = [
    ("v2 systemd containerd burstable",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
     f"cri-containerd-{CID}.scope\n",
     CgroupOwner(CID, UID, "containerd")),
    ("v2 systemd containerd guaranteed",
     f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     CgroupOwner(CID, UID, "containerd")),
    ("v2 systemd containerd besteffort",
     f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
     f"cri-containerd-{CID}.scope\n",
     CgroupOwner(CID, UID, "containerd")),
    ("v2 cgroupfs containerd",
     f"0::/kubepods/besteffort/pod{UID}/{CID}\n",
     CgroupOwner(CID, UID, None)),
    ("v2 cgroupfs containerd guaranteed",
     f"0::/kubepods/pod{UID}/{CID}\n",
     CgroupOwner(CID, UID, None)),
    ("v2 systemd CRI-O",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
     f"crio-{CID}.scope\n",
     CgroupOwner(CID, UID, "cri-o")),
    ("v2 cgroupfs CRI-O",
     f"0::/kubepods/burstable/pod{UID}/crio-{CID}\n",
     CgroupOwner(CID, UID, "cri-o")),
    ("v2 systemd cri-dockerd",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
     f"docker-{CID}.scope\n",
     CgroupOwner(CID, UID, "docker")),
    ("v1 systemd containerd, every controller",
     "".join(f"{n}:{c}:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
             f"cri-containerd-{CID}.scope\n"
             for n, c in ((12, "pids"), (11, "hugetlb"), (10, "net_cls,net_prio"),
                          (9, "cpu,cpuacct"), (8, "memory"), (7, "devices"),
                          (1, "name=systemd")))
     + "0::/\n",
     CgroupOwner(CID, UID, "containerd")),
    ("v1 cgroupfs CRI-O",
     f"11:memory:/kubepods/burstable/pod{UID}/crio-{CID}\n"
     f"4:cpu,cpuacct:/kubepods/burstable/pod{UID}/crio-{CID}\n"
     f"1:name=systemd:/kubepods/burstable/pod{UID}/crio-{CID}\n",
     CgroupOwner(CID, UID, "cri-o")),
    ("hybrid: v1 names the container, the unified line is the root",
     f"0::/\n5:devices:/kubepods/burstable/pod{UID}/{CID}\n",
     CgroupOwner(CID, UID, None)),
    ("private cgroup namespace: the path climbs out of the reader's root",
     f"0::/../../kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     CgroupOwner(CID, UID, "containerd")),
    ("kind: the kubelet's cgroup root is kubelet.slice",
     f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
     f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
     CgroupOwner(CID, UID, "containerd")),
    ("a sub-cgroup the container made for itself",
     f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope/init.scope\n",
     CgroupOwner(CID, UID, "containerd")),
    ("a static pod (UID is a hash)",
     f"0::/kubepods/burstable/pod{STATIC_UID}/{CID}\n",
     CgroupOwner(CID, STATIC_UID, None)),
    ("CRI-O's conmon: in the pod, in no container",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
     f"crio-conmon-{CID}.scope\n",
     CgroupOwner(None, UID, None)),
    ("an unknown runtime's container spelling: the pod only",
     f"0::/kubepods/burstable/pod{UID}/garden-7a3c\n",
     CgroupOwner(None, UID, None)),
    ("docker outside Kubernetes: a container, no pod",
     f"0::/system.slice/docker-{CID}.scope\n",
     CgroupOwner(CID, None, "docker")),
    ("a host service", "0::/system.slice/nvidia-persistenced.service\n", None),
    ("a login session", "0::/user.slice/user-1000.slice/session-4.scope\n", None),
    ("the root cgroup", "0::/\n", None),
    ("a bare 64-hex directory outside any pod is no container", f"0::/machine/{CID}\n", None),
    ("empty", "", None),
    ("not a cgroup file", "hello world\n", None),
    ("a 63-hex ID is not an ID", f"0::/kubepods/pod{UID}/{CID[:-1]}\n",
     CgroupOwner(None, UID, None)),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cgroup_text_names_the_container_and_pod(text, expected):
    assert parse_cgroup(text) == expected


def test_reader_reads_under_the_proc_root_it_is_given(tmp_path):
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(CASES[0][1])
    assert CgroupReader(str(tmp_path)).owner(4242) == CASES[0][2]


def test_a_pid_gone_before_its_cgroup_is_read_has_no_owner_and_no_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert CgroupReader(str(tmp_path)).owner(99999) is None
    assert caplog.records == []


def test_an_unreadable_cgroup_file_has_no_owner_and_is_logged_once(tmp_path, caplog):
    for pid in (7, 8):
        # a directory where the file should be: reading it fails whatever our privileges
        os.makedirs(tmp_path / str(pid) / "cgroup")
    reader = CgroupReader(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert reader.owner(7) is None
        assert reader.owner(8) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot read" in warnings[0] and "/7/cgroup" in warnings[0]


def test_a_cgroup_file_that_is_not_utf8_is_read_not_raised(tmp_path):
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "cgroup").write_bytes(b"0::/\xff\xfe/" + f"kubepods/pod{UID}/{CID}".encode())
    assert CgroupReader(str(tmp_path)).owner(5) == CgroupOwner(CID, UID, None)
