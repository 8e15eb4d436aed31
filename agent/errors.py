"""Errors that carry their own exit code and a one-line message for the user."""

from __future__ import annotations


class AgentError(Exception):
    """Base of our own errors. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class LabelWriteError(AgentError):
    """A label sink could not publish the labels; the sink has logged why (once per change of
    state). The publisher counts it and the agent is not ready until a write works."""


class UsageError(AgentError):
    """The user gave bad input (a flag, a file, a device list): exit 2, one clear line."""

    exit_code = 2


class ConfigError(UsageError):
    """A configuration file or value is invalid. The message names file, key and expectation."""


class InputFormatError(UsageError):
    """A file the user supplied (a machine spec, a pasted topology) cannot be read."""


class AllocationError(UsageError):
    """An allocation request is invalid (size, unknown/duplicate IDs, must-include outside
    available). The gRPC layer turns it into INVALID_ARGUMENT."""


#: How much of an untrusted value (a device ID from a gRPC request, a path) goes into a
#: message or a log line: enough to recognise it, never megabytes.
SHORTEN_LIMIT = 80


def shorten(value: object, limit: int = SHORTEN_LIMIT) -> str:
    """``str(value)`` cut to ``limit`` characters, with how long it really was:
    ``"GPU-aaaa...(+1048490 chars)"``. Untrusted input goes through this before it reaches
    an error message or the log (a 1 MB device ID would otherwise make the gRPC status
    itself too large)."""
    text = str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...(+{len(text) - limit} chars)"


class MigError(AgentError):
    """A MIG operation NVML refused: the message names the GPU, the profile or instance
    and NVML's answer."""


class MigInsufficientResources(MigError):
    """NVML_ERROR_INSUFFICIENT_RESOURCES: the placement is taken (or overlaps one)."""


class MigInUse(MigError):
    """NVML_ERROR_IN_USE: the instance runs processes (or holds compute instances)."""


class MigResetRequired(MigError):
    """The MIG mode change is pending a GPU reset (Ampere): the agent never resets a GPU."""


class MigNotFound(MigError):
    """NVML_ERROR_NOT_FOUND / INVALID_ARGUMENT: no such GPU instance (already destroyed)."""
