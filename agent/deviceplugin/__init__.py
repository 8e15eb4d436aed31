"""The kubelet device-plugin v1beta1 side of the agent: resources and device IDs
(:mod:`.resources`), request handling (:mod:`.allocation`), gRPC servicer and server
(:mod:`.server`), and the manager that serves, registers and watches the kubelet
(:mod:`.manager`)."""
