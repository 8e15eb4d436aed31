"""The one definition of each small parser every layer shares (agent.formats): cpulists, PCI
bus ids, HOST:PORT, and YAML/JSON documents read from a file."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.errors import InputFormatError, UsageError
from agent.formats import (
    BusIdError,
    format_cpulist,
    nvml_to_sysfs_bus_id,
    parse_bus_id,
    parse_cpulist,
    parse_host_port,
    read_document,
    sysfs_to_nvml_bus_id,
)


# --------------------------------------------------------------------------- cpulists
def test_cpulist_is_read_as_the_kernel_writes_it_and_written_back_the_same():
    # real /sys/devices/system/node/node1/cpulist of a 2-socket, 224-thread host
    assert parse_cpulist("56-111,168-223\n") == [*range(56, 112), *range(168, 224)]
    assert format_cpulist(parse_cpulist("56-111,168-223\n")) == "56-111,168-223"
    assert parse_cpulist("0-15:2/4") == [0, 1, 4, 5, 8, 9, 12, 13]  # strided groups
    assert parse_cpulist("\n") == []  # a memory-only NUMA node
    for bad in ("3-1", "a", "0-7:0/4", "1,,2"):
        with pytest.raises(ValueError, match="bad cpulist"):
            parse_cpulist(bad)


@given(st.sets(st.integers(0, 300), max_size=40))
@settings(max_examples=60)
def test_any_cpu_set_round_trips_through_its_cpulist(cpus):
    assert parse_cpulist(format_cpulist(cpus)) == sorted(cpus)


# --------------------------------------------------------------------------- PCI bus ids
def test_bus_ids_in_nvml_and_sysfs_spelling_convert_both_ways_and_device_above_0x1f_is_rejected():
    assert nvml_to_sysfs_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert sysfs_to_nvml_bus_id("0000:3b:00.0") == "00000000:3B:00.0"
    assert nvml_to_sysfs_bus_id("00010000:01:00.0") == "10000:01:00.0"  # a VMD domain
    assert parse_bus_id("0000:c1:1f.7") == (0, 0xC1, 0x1F, 7)
    with pytest.raises(BusIdError, match=r"device number 0x20 > 0x1f"):
        parse_bus_id("0000:3b:20.0")
    for bad in ("3b:00.0", "0000:3b:00.8", "GPU-0", ""):
        with pytest.raises(BusIdError, match="not a PCI bus id") as info:
            parse_bus_id(bad)
        assert isinstance(info.value, UsageError) and isinstance(info.value, ValueError)


@given(st.integers(0, 0xFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7))
@settings(max_examples=50)
def test_any_bus_id_round_trips_between_the_two_spellings(domain, bus, dev, fn):
    sysfs = f"{domain:04x}:{bus:02x}:{dev:02x}.{fn}"
    nvml = sysfs_to_nvml_bus_id(sysfs)
    assert len(nvml) == 16 and nvml == nvml.upper()
    assert nvml_to_sysfs_bus_id(nvml) == sysfs


# --------------------------------------------------------------------------- HOST:PORT
def test_host_port_forms_and_the_error_names_what_was_given():
    assert parse_host_port("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert parse_host_port(":9400") == ("", 9400)  # all interfaces
    assert parse_host_port("[::1]:0") == ("::1", 0)  # port 0: pick a free one
    for bad in ("9400", "host:port", "x:70000", ""):
        with pytest.raises(ValueError, match=r"metrics address .*expected HOST:PORT"):
            parse_host_port(bad, "metrics address")


# --------------------------------------------------------------------------- documents
def test_documents_are_read_as_yaml_or_json_and_other_encodings_are_one_clear_line(tmp_path):
    yaml_file = tmp_path / "config.yaml"
    yaml_file.write_text("version: v1\nflags:\n  migStrategy: none\n", encoding="utf-8")
    assert read_document(str(yaml_file)) == {"version": "v1", "flags": {"migStrategy": "none"}}
    json_file = tmp_path / "spec.json"
    json_file.write_bytes(b'\xef\xbb\xbf{"name": "m\xc3\xbcnchen"}')  # UTF-8 with a BOM
    assert read_document(str(json_file)) == {"name": "münchen"}

    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: m\u00fcnchen\n".encode("latin-1"))
    utf16 = tmp_path / "utf16.yaml"
    utf16.write_bytes("version: v1\n".encode("utf-16"))  # with its byte-order mark
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": ', encoding="utf-8")
    cases = [
        (latin1, "config file is not UTF-8 text: byte 0xfc at offset 7; save it as UTF-8"),
        (utf16, "starts with a UTF-16 byte-order mark"),
        (broken, "not valid JSON"),
        (tmp_path / "absent.yaml", "cannot read config file"),
    ]
    for path, expected in cases:
        with pytest.raises(InputFormatError) as info:
            read_document(str(path), "config file")
        message = str(info.value)
        assert message.startswith(f"{path}: ") and expected in message and "\n" not in message
        assert info.value.exit_code == 2


def test_aliases_are_expanded_within_a_bound_and_a_bomb_is_one_short_line(tmp_path):
    ok = tmp_path / "anchors.yaml"
    ok.write_text("base: &gpu {replicas: 2}\nfirst: *gpu\nsecond: {<<: *gpu, rename: shared}\n", encoding="utf-8")
    assert read_document(str(ok)) == {
        "base": {"replicas": 2}, "first": {"replicas": 2}, "second": {"replicas": 2, "rename": "shared"},
    }
    bomb = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
        f"{b}: &{b} [{','.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")
    )
    cases = [
        (bomb, "more than 50000 values once its aliases are expanded"),
        ("a: &a [1, *a]\n", "an alias inside the value it names"),
        ("a: " + "[" * 200 + "]" * 200 + "\n", "nested deeper than 100 levels"),
        ("a: [" + "1," * 60_000 + "1]\n", "more than 50000 values"),
    ]
    for text, expected in cases:
        path = tmp_path / "bad.yaml"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(InputFormatError) as info:
            read_document(str(path), "config file")
        assert str(info.value) == f"{path}: config file refused: {expected}"


def test_a_file_above_one_mebibyte_is_refused_unread_and_deep_json_is_one_line(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("a: " + "x" * (1 << 20) + "\n", encoding="utf-8")
    with pytest.raises(InputFormatError, match=r"big\.yaml: machine spec is larger than 1048576 bytes \(1 MiB\)$"):
        read_document(str(big), "machine spec")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    with pytest.raises(InputFormatError, match=r"deep\.json: machine spec refused: nested too deeply$"):
        read_document(str(deep), "machine spec")
