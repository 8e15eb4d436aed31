"""The demo: the real agent on a simulated machine against an in-process stand-in kubelet."""
