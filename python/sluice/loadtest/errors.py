"""Errors that stop a benchmark before it starts; each carries a message meant for the user."""

from __future__ import annotations

from sluice.errors import SluiceError


class BenchError(SluiceError):
    """Bad input to the harness: an unreachable server, a bad option, an unparsable dataset."""


class DatasetError(BenchError):
    """A dataset that cannot be read or yields no usable requests."""
