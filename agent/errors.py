"""Errors that carry their own exit code and a one-line message for the user."""

from __future__ import annotations


class AgentError(Exception):
    """Base of our own errors. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


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
