"""load_config: the NVIDIA device plugin file (v1), environment, flags, precedence, errors."""

from __future__ import annotations

import json

import pytest

from agent.config import DEFAULT_IGNORED_XIDS, Config, describe_config, is_critical_xid, load_config
from agent.errors import ConfigError

NVIDIA_FILE = """\
version: v1
flags:
  migStrategy: mixed
  failOnInitError: false
  nvidiaDriverRoot: /run/nvidia/driver
  plugin:
    passDeviceSpecs: true
    deviceListStrategy: [envvar, cdi-cri]
    deviceIDStrategy: index
    cdiAnnotationPrefix: cdi.example.com/
  gfd:
    oneshot: false
sharing:
  timeSlicing:
    renameByDefault: true
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
      devices: [0, "GPU-aaaa", "1:2"]
    - name: nvidia.com/mig-1g.10gb
      replicas: 2
      rename: small
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_no_sources_gives_the_real_node_defaults():
    assert load_config(None, {}, {}) == Config()


def test_nvidia_config_file_sets_every_field_it_names(tmp_path):
    path = write(tmp_path, "config.yaml", NVIDIA_FILE)
    c = load_config(path, {}, {})
    assert c.mig_strategy == "mixed"
    assert c.fail_on_init_error is False
    assert c.nvidia_driver_root == "/run/nvidia/driver"
    assert c.pass_device_specs is True
    assert c.device_list_strategy == ("envvar", "cdi-cri")
    assert c.device_id_strategy == "index"
    assert c.cdi_annotation_prefix == "cdi.example.com/"
    assert c.rename_by_default is True and c.fail_requests_greater_than_one is True
    gpu, mig = c.time_slicing
    assert (gpu.name, gpu.replicas, gpu.devices, gpu.rename) == ("nvidia.com/gpu", 4, ("0", "GPU-aaaa", "1:2"), None)
    assert (mig.name, mig.replicas, mig.devices, mig.rename) == ("nvidia.com/mig-1g.10gb", 2, None, "small")
    assert c.config_file == path


def test_json_config_file_is_read_like_yaml(tmp_path):
    doc = {"version": "v1", "flags": {"plugin": {"deviceListStrategy": "volume-mounts"}}}
    c = load_config(write(tmp_path, "c.json", json.dumps(doc)), {}, {})
    assert c.device_list_strategy == ("volume-mounts",)


def test_precedence_is_flags_over_env_over_file(tmp_path):
    path = write(tmp_path, "c.yaml", "version: v1\nflags:\n  migStrategy: single\n  plugin:\n    deviceIDStrategy: index\n")
    env = {"MIG_STRATEGY": "mixed", "DEVICE_ID_STRATEGY": "uuid"}
    c = load_config(path, env, {"mig_strategy": "none", "device_id_strategy": None})
    assert c.mig_strategy == "none"  # flag wins
    assert c.device_id_strategy == "uuid"  # env wins over file; a None flag is "not given"


def test_config_file_comes_from_config_file_env_when_no_flag(tmp_path):
    path = write(tmp_path, "c.yaml", "version: v1\nflags:\n  migStrategy: single\n")
    assert load_config(None, {"CONFIG_FILE": path}, {}).mig_strategy == "single"


def test_nvidia_env_vars_are_honoured():
    env = {
        "FAIL_ON_INIT_ERROR": "false",
        "PASS_DEVICE_SPECS": "true",
        "DEVICE_LIST_STRATEGY": "envvar,volume-mounts",
        "NODE_NAME": "node-7",
    }
    c = load_config(None, env, {})
    assert c.fail_on_init_error is False and c.pass_device_specs is True
    assert c.device_list_strategy == ("envvar", "volume-mounts")
    assert c.node_name == "node-7"


def test_dp_disable_healthchecks_all_turns_health_checks_off():
    assert load_config(None, {"DP_DISABLE_HEALTHCHECKS": "all"}, {}).health_checks_enabled is False


def test_dp_disable_healthchecks_list_adds_ignored_xids():
    c = load_config(None, {"DP_DISABLE_HEALTHCHECKS": "48, 79"}, {})
    assert c.health_checks_enabled is True
    assert not is_critical_xid(c, 48) and not is_critical_xid(c, 79)
    assert is_critical_xid(c, 94)


def test_dp_enable_healthchecks_makes_ignored_xids_critical():
    c = load_config(None, {"DP_ENABLE_HEALTHCHECKS": "13"}, {})
    assert is_critical_xid(c, 13) and not is_critical_xid(c, 31)
    assert all(is_critical_xid(load_config(None, {"DP_ENABLE_HEALTHCHECKS": "all"}, {}), x) for x in DEFAULT_IGNORED_XIDS)


def test_default_ignored_xids_are_nvidias():
    c = Config()
    assert [x for x in (13, 31, 43, 45, 68, 109, 48, 79) if not is_critical_xid(c, x)] == [13, 31, 43, 45, 68, 109]


def test_health_section_sets_xids_and_recovery_period(tmp_path):
    path = write(tmp_path, "c.yaml", "version: v1\nhealth:\n  ignoredXids: [13]\n  criticalXids: [13]\n  recoverySeconds: 2.5\n")
    c = load_config(path, {}, {})
    assert c.ignored_xids == (13,) and is_critical_xid(c, 13) and c.health_recovery_s == 2.5


@pytest.mark.parametrize(
    "text, key, expected",
    [
        ("version: v2\n", "version", "v1"),
        ("version: v1\nflags:\n  migStrategy: some\n", "flags.migStrategy", "none, single, mixed"),
        ("version: v1\nflags:\n  plugin:\n    deviceListStrategy: [envvar, bogus]\n", "flags.plugin.deviceListStrategy", "envvar"),
        ("version: v1\nflags:\n  plugin:\n    deviceIDStrategy: serial\n", "flags.plugin.deviceIDStrategy", "uuid, index"),
        ("version: v1\nflags:\n  failOnInitError: maybe\n", "flags.failOnInitError", "true or false"),
        ("version: v1\nflagz: {}\n", "flagz", "unknown key"),
        ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 0\n", "sharing.timeSlicing.resources[0].replicas", "integer >= 1"),
        ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: amd.com/gpu\n      replicas: 2\n", "sharing.timeSlicing.resources[0].name", "nvidia.com/gpu"),
        ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n      devices: [fast]\n", "devices", "GPU indices"),
        ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n      rename: a/b\n", "rename", "without a domain"),
        ("version: v1\nhealth:\n  recoverySeconds: soon\n", "health.recoverySeconds", "a number"),
        ("version: v1\nsharing:\n  mps:\n    resources: []\n", "sharing.mps.resources", "at least one resource"),
        ("version: v1\nflags: [1]\n", "flags", "mapping"),
    ],
)
def test_bad_file_names_file_key_and_expectation(tmp_path, text, key, expected):
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_config(path, {}, {})
    message = str(info.value)
    assert path in message and key in message and expected in message
    assert "\n" not in message
    assert info.value.exit_code == 2


def test_unparseable_yaml_is_a_one_line_config_error(tmp_path):
    path = write(tmp_path, "bad.yaml", "version: v1\nflags: [\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_config(path, {}, {})
    assert "\n" not in str(info.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "absent.yaml"), {}, {})


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match="environment MIG_STRATEGY: expected one of none, single, mixed"):
        load_config(None, {"MIG_STRATEGY": "half"}, {})


def test_bad_flag_value_names_the_flag():
    with pytest.raises(ConfigError, match="--log-format"):
        load_config(None, {}, {"log_format": "xml"})
    with pytest.raises(ConfigError, match="metrics_address"):
        load_config(None, {}, {"metrics_address": "localhost"})


def test_mig_time_slicing_needs_mixed_strategy(tmp_path):
    path = write(tmp_path, "c.yaml", "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/mig-1g.10gb\n      replicas: 2\n")
    with pytest.raises(ConfigError, match="needs migStrategy mixed"):
        load_config(path, {}, {})


def test_effective_config_description_is_json_serialisable(tmp_path):
    c = load_config(write(tmp_path, "c.yaml", NVIDIA_FILE), {}, {})
    text = json.dumps(describe_config(c))
    assert '"replicas": 4' in text and '"mig_strategy": "mixed"' in text


def test_metrics_section_sets_the_sampler_refresh_and_idle_threshold(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        "version: v1\nmetrics:\n  sampleIntervalSeconds: 2\n  podResourcesRefreshSeconds: 30\n"
        "  idleThresholdPercent: 12.5\n"
    )
    config = load_config(str(path), {}, {})
    assert (config.sample_interval_s, config.pod_resources_refresh_s) == (2.0, 30.0)
    assert config.idle_utilization_threshold_pct == 12.5
    env = load_config(str(path), {"SAMPLE_INTERVAL_S": "5", "POD_RESOURCES_REFRESH_S": "7"}, {})
    assert (env.sample_interval_s, env.pod_resources_refresh_s) == (5.0, 7.0)


@pytest.mark.parametrize(
    "body, key",
    [
        ("metrics:\n  sampleIntervalSeconds: 0\n", "metrics.sampleIntervalSeconds"),
        ("metrics:\n  idleThresholdPercent: 150\n", "metrics.idleThresholdPercent"),
        ("metrics:\n  scrapeEvery: 3\n", "metrics"),
        ("flags:\n  allocationPolicy: fastest\n", "flags.allocationPolicy"),
    ],
)
def test_bad_metrics_values_and_unknown_allocation_policies_name_the_key(tmp_path, body, key):
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\n" + body)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), {}, {})
    assert str(path) in str(info.value) and key in str(info.value)


def test_config_file_that_is_not_utf8_is_a_one_line_config_error(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes("version: v1\n# r\u00e9glages du n\u0153ud\n".encode("cp1252"))
    with pytest.raises(ConfigError) as info:
        load_config(str(path), {}, {})
    message = str(info.value)
    assert message.startswith(f"{path}: config file is not UTF-8 text") and "\n" not in message
    assert info.value.exit_code == 2


def test_metrics_address_error_names_the_config_file(tmp_path):
    path = write(tmp_path, "c.yaml", "version: v1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: metrics_address ':x': expected HOST:PORT"):
        load_config(path, {}, {"metrics_address": ":x"})


# ---------------------------------------------------------------------- the label sink, the API server
def test_labels_sink_and_kubeconfig_are_a_flag_an_environment_variable_and_a_file_key(tmp_path):
    path = write(tmp_path, "c.yaml", "version: v1\nflags:\n  labelsSink: nodefeature\n  kubeconfig: /k/file\n")
    assert load_config(path, {}, {}).labels_sink == "nodefeature"
    assert load_config(path, {}, {}).kubeconfig == "/k/file"
    env = {"LABELS_SINK": "file", "KUBECONFIG": "/k/env"}
    assert (load_config(path, env, {}).labels_sink, load_config(path, env, {}).kubeconfig) == ("file", "/k/env")
    flags = {"labels_sink": "nodefeature", "kubeconfig": "/k/flag"}
    assert (load_config(path, env, flags).labels_sink, load_config(path, env, flags).kubeconfig) == (
        "nodefeature", "/k/flag")
    assert Config().labels_sink == "file" and Config().kubeconfig == ""


def test_nvidias_use_node_feature_api_chooses_the_nodefeature_sink(tmp_path):
    on = write(tmp_path, "on.yaml", "version: v1\nflags:\n  useNodeFeatureAPI: true\n")
    off = write(tmp_path, "off.yaml", "version: v1\nflags:\n  useNodeFeatureAPI: false\n")
    assert load_config(on, {}, {}).labels_sink == "nodefeature"
    assert load_config(off, {}, {}).labels_sink == "file"
    both = write(tmp_path, "both.yaml", "version: v1\nflags:\n  useNodeFeatureAPI: true\n  labelsSink: file\n")
    with pytest.raises(ConfigError, match="flags.useNodeFeatureAPI: says nodefeature but flags.labelsSink says file"):
        load_config(both, {}, {})


@pytest.mark.parametrize("text, message", [
    ("version: v1\nflags:\n  labelsSink: configmap\n", "flags.labelsSink: expected one of file, nodefeature"),
    ("version: v1\nflags:\n  kubeconfig: /a\ndra:\n  kubeconfig: /b\n", "dra.kubeconfig: differs from flags.kubeconfig"),
])
def test_bad_label_sink_settings_name_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, "c.yaml", text), {}, {})


def test_the_pods_identity_comes_from_the_downward_api_variables():
    config = load_config(None, {"POD_NAMESPACE": "gpu", "POD_NAME": "gta-1", "POD_UID": "u-1"}, {})
    assert (config.pod_namespace, config.pod_name, config.pod_uid) == ("gpu", "gta-1", "u-1")
    with pytest.raises(ConfigError, match="environment LABELS_SINK: expected one of file, nodefeature"):
        load_config(None, {"LABELS_SINK": "api"}, {})


MEGABYTE = "x" * 1_000_000


@pytest.mark.parametrize(
    "body, key",
    [
        (f"flags:\n  migStrategy: {MEGABYTE}\n", "flags.migStrategy"),
        (f"version: v1{MEGABYTE}\n", "version"),
        (f"flags:\n  ? {MEGABYTE}\n  : 1\n", "flags.xxxx"),  # a long key is written "? key"
        (f"sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
         f"      devices: [{MEGABYTE}]\n", "sharing.timeSlicing.resources[0].devices"),
        (f"sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/mig-{MEGABYTE}\n      replicas: 2\n",
         "sharing.timeSlicing.resources"),
        (f"dra:\n  driverName: {MEGABYTE}\n", "dra.driverName"),
    ],
)
def test_a_megabyte_config_value_is_shortened_in_its_one_line_error(tmp_path, body, key):
    text = body if body.startswith("version") else "version: v1\n" + body
    path = write(tmp_path, "c.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_config(path, {}, {})
    message = str(info.value)
    assert message.startswith(f"{path}: ") and key in message, message[:300]
    assert "chars)" in message and len(message) < 500 and "\n" not in message


def test_a_megabyte_environment_or_flag_value_is_shortened_in_its_error():
    for env, flags, where in (
        ({"MIG_STRATEGY": MEGABYTE}, {}, "environment MIG_STRATEGY"),
        ({"DP_DISABLE_HEALTHCHECKS": MEGABYTE}, {}, "environment DP_DISABLE_HEALTHCHECKS"),
        ({}, {"metrics_address": MEGABYTE}, "metrics_address"),
        ({}, {"sample_interval_s": MEGABYTE}, "--sample-interval-s"),
    ):
        with pytest.raises(ConfigError) as info:
            load_config(None, env, flags)
        message = str(info.value)
        assert where in message and "chars)" in message and len(message) < 500, message[:300]


def test_proc_root_and_cri_socket_come_from_flags_or_env_and_take_the_kubelets_spelling():
    from agent.cli import build_parser

    assert Config().proc_root == "/proc" and Config().cri_socket == "/run/containerd/containerd.sock"
    env = {"PROC_ROOT": "/host/proc", "CRI_SOCKET": "unix:///var/run/crio/crio.sock"}
    c = load_config(None, env, {})
    assert (c.proc_root, c.cri_socket) == ("/host/proc", "/var/run/crio/crio.sock")
    args = build_parser().parse_args(["run", "--proc-root", "/hp", "--cri-socket", "/run/k3s/c.sock"])
    c = load_config(None, env, {"proc_root": args.proc_root, "cri_socket": args.cri_socket})
    assert (c.proc_root, c.cri_socket) == ("/hp", "/run/k3s/c.sock")


# ----------------------------------------------------------------------------- issue 18
def test_imex_section_flags_and_environment_set_the_channels(tmp_path):
    path = write(tmp_path, "c.yaml", "version: v1\nimex:\n  channelIDs: [0]\n  required: true\n")
    c = load_config(path, {}, {})
    assert (c.imex_channel_ids, c.imex_required) == ((0,), True)
    assert load_config(write(tmp_path, "e.yaml", "version: v1\nimex:\n  channelIDs: []\n"), {}, {}).imex_channel_ids == ()
    assert load_config(None, {"IMEX_CHANNEL_IDS": "0", "IMEX_REQUIRED": "true"}, {}).imex_required is True
    assert load_config(None, {}, {"imex_channel_ids": "0"}).imex_channel_ids == (0,)


@pytest.mark.parametrize("text, message", [
    ("imex:\n  channelIDs: [1]\n", r"imex.channelIDs: expected \[\] or \[0\] .*got \[1\]"),
    ("imex:\n  channelIDs: [0, 0]\n", r"imex.channelIDs: expected \[\] or \[0\]"),
    ("imex:\n  required: maybe\n", r"imex.required: expected true or false, got 'maybe'"),
    ("imex:\n  channels: [0]\n", r"imex.channels: unknown key \(expected one of channelIDs, required\)"),
    ("flags:\n  imexChannelIDs: [0]\n", r"flags.imexChannelIDs: not a key of this format; IMEX channels are set in"
                                         r" the top-level imex section"),
])
def test_bad_imex_settings_name_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, "c.yaml", "version: v1\n" + text), {}, {})


def test_per_node_config_settings_come_from_config_managers_variables():
    c = load_config(None, {"CONFIG_FILE_SRCDIR": "/etc/configs", "DEFAULT_CONFIG": "a100",
                           "NODE_LABEL": "example.com/gpu-config", "FALLBACK_STRATEGIES": "single"}, {})
    assert (c.config_file_srcdir, c.default_config, c.node_label, c.fallback_strategies) == (
        "/etc/configs", "a100", "example.com/gpu-config", ("single",))
    d = Config()
    assert (d.config_file_srcdir, d.default_config, d.node_label, d.fallback_strategies) == (
        "", "", "nvidia.com/device-plugin.config", ("named", "single"))
    with pytest.raises(ConfigError, match=r"environment NODE_LABEL: expected a label key"):
        load_config(None, {"NODE_LABEL": "not a/label/key"}, {})
    with pytest.raises(ConfigError, match=r"--default-config: expected a config name"):
        load_config(None, {}, {"default_config": "../etc/passwd"})


def test_the_gpu_set_withdrawal_grace_is_a_flag_an_environment_variable_and_a_file_key(tmp_path):
    path = write(tmp_path, "c.yaml", "version: v1\ndra:\n  gpuSetWithdrawalGraceSeconds: 90\n")
    assert Config().gpu_set_withdrawal_grace_s == 60.0
    assert load_config(path, {}, {}).gpu_set_withdrawal_grace_s == 90.0
    env = {"DRA_GPU_SET_WITHDRAWAL_GRACE_S": "0"}
    assert load_config(path, env, {}).gpu_set_withdrawal_grace_s == 0.0
    assert load_config(path, env, {"gpu_set_withdrawal_grace_s": 30.0}).gpu_set_withdrawal_grace_s == 30.0
    bad = write(tmp_path, "bad.yaml", "version: v1\ndra:\n  gpuSetWithdrawalGraceSeconds: soon\n")
    with pytest.raises(ConfigError, match=r"dra.gpuSetWithdrawalGraceSeconds: expected a number, got 'soon'"):
        load_config(bad, {}, {})
    with pytest.raises(ConfigError, match=r"environment DRA_GPU_SET_WITHDRAWAL_GRACE_S: expected a number >= 0"):
        load_config(None, {"DRA_GPU_SET_WITHDRAWAL_GRACE_S": "-1"}, {})
    with pytest.raises(ConfigError, match=r"--gpu-set-withdrawal-grace-s: expected a number >= 0"):
        load_config(None, {}, {"gpu_set_withdrawal_grace_s": -5.0})
