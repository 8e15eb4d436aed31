"""``sharing.mps`` and the MPS settings as NVIDIA's config v1 defines them: the fields and
rules of its ``ReplicatedResources``, MPS exclusive with time-slicing, no MIG devices, and
``mpsRoot`` / the control program as file keys, environment variables and flags."""

from __future__ import annotations

import pytest

from agent.config import Config, TimeSlicingResource, load_config
from agent.errors import ConfigError
from agent.sharing import sharing_for, strategy_label

MPS_FILE = """\
version: v1
flags:
  mpsRoot: /var/run/mps
sharing:
  mps:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
      devices: [0, 1]
      rename: gpu-quarter
"""


def write(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_mps_section_reads_every_field_of_nvidias_replicated_resources(tmp_path):
    c = load_config(write(tmp_path, MPS_FILE), {}, {})
    assert c.mps == (TimeSlicingResource("nvidia.com/gpu", 4, "gpu-quarter", ("0", "1")),)
    assert c.time_slicing == ()
    assert c.rename_by_default is True
    assert c.mps_root == "/var/run/mps"
    assert (strategy_label(c), sharing_for(c).section) == ("mps", "sharing.mps")


def test_mps_refuses_requests_above_one_unless_the_file_says_otherwise(tmp_path):
    # NVIDIA's device plugin's historical MPS behaviour: failRequestsGreaterThanOne defaults to true
    c = load_config(write(tmp_path, "version: v1\nsharing:\n  mps:\n    resources:\n"
                                    "    - {name: nvidia.com/gpu, replicas: 2}\n"), {}, {})
    assert c.fail_requests_greater_than_one is True
    c = load_config(write(tmp_path, "version: v1\nsharing:\n  mps:\n    failRequestsGreaterThanOne: false\n"
                                    "    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n"), {}, {})
    assert c.fail_requests_greater_than_one is False


def test_mps_defaults_are_nvidias():
    c = Config()
    assert (c.mps_root, c.mps_control_binary, strategy_label(c)) == (
        "/run/nvidia/mps", "nvidia-cuda-mps-control", "none"
    )


def test_mps_root_and_control_binary_come_from_file_env_and_flags_in_that_order(tmp_path):
    path = write(tmp_path, "version: v1\nflags:\n  mpsRoot: /file/mps\n  mpsControlBinary: /file/mps-control\n")
    c = load_config(path, {}, {})
    assert (c.mps_root, c.mps_control_binary) == ("/file/mps", "/file/mps-control")
    env = {"MPS_ROOT": "/env/mps", "MPS_CONTROL_BINARY": "mps-control-from-env"}
    c = load_config(path, env, {})
    assert (c.mps_root, c.mps_control_binary) == ("/env/mps", "mps-control-from-env")
    c = load_config(path, env, {"mps_root": "/flag/mps", "mps_control_binary": "/flag/ctl"})
    assert (c.mps_root, c.mps_control_binary) == ("/flag/mps", "/flag/ctl")


def test_relative_control_binary_path_is_made_absolute_and_a_bare_name_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(None, {}, {"mps_control_binary": "bin/ctl"}).mps_control_binary == str(tmp_path / "bin/ctl")
    assert load_config(None, {}, {"mps_control_binary": "ctl"}).mps_control_binary == "ctl"


@pytest.mark.parametrize(
    "sharing, key, expected",
    [
        ("  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n"
         "  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
         "sharing:", "timeSlicing and mps are exclusive"),
        ("  mps:\n    resources:\n    - {name: nvidia.com/mig-1g.10gb, replicas: 2}\n",
         "sharing.mps.resources[0].name", "MPS cannot share MIG devices"),
        ("  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2, devices: ['0:1']}\n",
         "sharing.mps.resources[0].devices", "MPS cannot share MIG devices"),
        ("  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2, devices: [MIG-aaaa]}\n",
         "sharing.mps.resources[0].devices", "MPS cannot share MIG devices"),
        ("  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 1}\n",
         "sharing.mps.resources[0].replicas", "integer >= 2"),
        ("  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: many}\n",
         "sharing.mps.resources[0].replicas", "integer >= 2"),
        ("  mps:\n    resources:\n    - {name: nvidia.com/gpu}\n",
         "sharing.mps.resources[0].replicas", "integer >= 2"),
        ("  mps:\n    resources:\n    - {name: amd.com/gpu, replicas: 2}\n",
         "sharing.mps.resources[0].name", "expected nvidia.com/gpu"),
        ("  mps:\n    resources: []\n", "sharing.mps.resources", "at least one resource"),
        ("  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2, slices: 3}\n",
         "sharing.mps.resources[0].slices", "unknown key"),
    ],
)
def test_bad_mps_section_is_one_line_naming_file_key_and_expectation(tmp_path, sharing, key, expected):
    path = write(tmp_path, "version: v1\nsharing:\n" + sharing)
    with pytest.raises(ConfigError) as info:
        load_config(path, {}, {})
    message = str(info.value)
    assert path in message and key in message and expected in message, message
    assert "\n" not in message and info.value.exit_code == 2


def test_mps_with_mig_strategy_mixed_is_refused_as_nvidias_plugin_refuses_it(tmp_path):
    path = write(tmp_path, "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  mps:\n    resources:\n"
                           "    - {name: nvidia.com/gpu, replicas: 2}\n")
    with pytest.raises(ConfigError, match="sharing.mps: MPS cannot share MIG devices.*migStrategy mixed"):
        load_config(path, {}, {})
    path = write(tmp_path, "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n")
    assert load_config(path, {}, {}).mps
    with pytest.raises(ConfigError, match="migStrategy mixed"):
        load_config(path, {"MIG_STRATEGY": "mixed"}, {})


def test_an_empty_time_slicing_section_beside_mps_is_no_conflict(tmp_path):
    path = write(tmp_path, "version: v1\nsharing:\n  timeSlicing: {}\n  mps:\n    resources:\n"
                           "    - {name: nvidia.com/gpu, replicas: 3}\n")
    assert strategy_label(load_config(path, {}, {})) == "mps"


@pytest.mark.parametrize("value", [" ", "dir/"])
def test_bad_control_binary_names_the_setting(value):
    with pytest.raises(ConfigError, match="environment MPS_CONTROL_BINARY: expected a program name"):
        load_config(None, {"MPS_CONTROL_BINARY": value}, {})
