"""Names vulture reports as unused in agent/ that are used by something it cannot see
(tests/test_static_checks.py runs vulture over agent/ and this file only: a name that only
tests/ or bench/ use is dead code, not an entry here).

Not a test module: vulture reads it, nothing imports it. Every entry says who uses it.
"""

# ruff: noqa: B018, F821
# (bare names and attribute reads are how a vulture whitelist marks a name as used)

# --- frameworks call these by name
_.GetAllocatableResources  # gRPC: PodResourcesLister servicer method (agent/demo/kubelet.py)
_.Get  # gRPC: PodResourcesLister servicer method (agent/demo/kubelet.py)
_.PreStartContainer  # gRPC: DevicePlugin servicer method the kubelet calls (agent/deviceplugin/server.py)
_.NodePrepareResources  # gRPC: DRA servicer method the kubelet calls (agent/dra/plugin.py)
_.NodeUnprepareResources  # gRPC: DRA servicer method the kubelet calls (agent/dra/plugin.py)
_.NodeWatchResources  # gRPC: DRAResourceHealth servicer method the kubelet calls (agent/dra/health_stream.py)
_.pool_name  # protobuf: DeviceIdentifier field set by attribute (agent/dra/health_stream.py)
_.GetInfo  # gRPC: plugin-registration servicer method the kubelet's watcher calls
_.NotifyRegistrationStatus  # gRPC: plugin-registration servicer method the kubelet calls
_.describe  # prometheus_client: Collector.describe() (registry auto-describe)
_.do_GET  # http.server: BaseHTTPRequestHandler dispatches GET here
_.log_message  # http.server: BaseHTTPRequestHandler's access log
protocol_version  # http.server: BaseHTTPRequestHandler class attribute (HTTP/1.1 keep-alive)
daemon_threads  # socketserver.ThreadingMixIn class attribute
allow_reuse_address  # socketserver.TCPServer class attribute
request_queue_size  # socketserver.TCPServer class attribute: the listen backlog
address_family  # socketserver.TCPServer class attribute: the IPv6 metrics listener's
_.handle_error  # socketserver.BaseServer hook: client resets logged quietly
_.setup  # socketserver.BaseRequestHandler hook: the metrics handler's TLS handshake and deadline
_.readable  # io.RawIOBase: BufferedReader asks it of the deadline reader (agent/http/endpoints.py)
_.readinto  # io.RawIOBase: BufferedReader reads through it (agent/http/endpoints.py)
_.writable  # io.RawIOBase: asked before writes (the metrics handler's writer, agent/http/endpoints.py)
_.rfile  # socketserver.StreamRequestHandler attribute: BaseHTTPRequestHandler reads the request from it
_.converter  # logging.Formatter: the time converter (UTC for the JSON log format)
_.retries  # kubernetes.client.Configuration: read by the client's urllib3 pool (agent/dra/publisher.py)

# --- record fields read generically or by other tools
allocation_policy  # Config field: flags.allocationPolicy, read through dataclasses.fields()
description  # machine spec field: documentation carried in the spec files
_.timestamp  # pynvml c_nvmlFieldValue_t field, filled as the real NVML fills it
_.scopeId  # pynvml c_nvmlFieldValue_t field, filled as the real NVML fills it
_.uiVal  # pynvml c_nvmlValue_t union member, filled as the real NVML fills it
_.ullVal  # pynvml c_nvmlValue_t union member, filled as the real NVML fills it
taken_at  # metrics Snapshot field: when the round was taken

# --- the simulator's runtime fault injection (agent/hw/sim/nvml_core.py), part of the fake
# pynvml's documented API (agent/hw/sim/nvml.py's docstring): the machine spec's ``faults:``
# is its static form (lost GPUs, unsupported functions, a failing nvmlInit) that the product
# reads; these change a running fake and are driven by tests/ and bench/bench_dra.py
_.lose_gpu  # tests (health, metrics, reliability)
_.recover_gpu  # tests (health recovery)
_.make_unsupported  # tests (metrics of unsupported functions)
_.make_missing  # tests (an older driver)
_.fail_init  # tests (NVML that does not load)
_.inject_xid  # tests and bench/bench_dra.py
_.inject_ecc_dbe  # tests (ECC events and counters)
_.set_value  # tests (telemetry knobs)
_.occupy_mig  # tests (processes in a GPU instance: destroying it is InUse)
_.__mul__  # agent/hw/sim/nvml_mig.py: ``c_nvmlGpuInstance_t * n`` arrays, as pynvml callers make them
