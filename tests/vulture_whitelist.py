"""Names vulture reports as unused in agent/ that are used by something it cannot see
(tests/test_static_checks.py runs vulture over agent/, tests/ and bench/ with this file).

Not a test module: vulture reads it, nothing imports it. Every entry says who uses it.
"""

# ruff: noqa: B018, F821
# (bare names and attribute reads are how a vulture whitelist marks a name as used)

# --- frameworks call these by name
_.GetAllocatableResources  # gRPC: PodResourcesLister servicer method (agent/demo/kubelet.py)
_.Get  # gRPC: PodResourcesLister servicer method (agent/demo/kubelet.py)
_.describe  # prometheus_client: Collector.describe() (registry auto-describe)
_.do_GET  # http.server: BaseHTTPRequestHandler dispatches GET here
_.log_message  # http.server: BaseHTTPRequestHandler's access log
protocol_version  # http.server: BaseHTTPRequestHandler class attribute (HTTP/1.1 keep-alive)
daemon_threads  # socketserver.ThreadingMixIn class attribute
allow_reuse_address  # socketserver.TCPServer class attribute
request_queue_size  # socketserver.TCPServer class attribute: the listen backlog
_.handle_error  # socketserver.BaseServer hook: client resets logged quietly
_.setup  # socketserver.BaseRequestHandler hook: the metrics handler's TLS handshake and deadline
_.readable  # io.RawIOBase: BufferedReader asks it of the deadline reader (agent/metrics/http.py)
_.readinto  # io.RawIOBase: BufferedReader reads through it (agent/metrics/http.py)
_.converter  # logging.Formatter: the time converter (UTC for the JSON log format)
_.retries  # kubernetes.client.Configuration: read by the client's urllib3 pool (agent/dra/publisher.py)

# --- record fields read generically or by other tools
allocation_policy  # Config field: flags.allocationPolicy, read through dataclasses.fields()
description  # machine spec field: documentation carried in the spec files
_.timestamp  # pynvml c_nvmlFieldValue_t field, filled as the real NVML fills it
taken_at  # metrics Snapshot field: when the round was taken

