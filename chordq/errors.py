"""chordq's exceptions. The CLI maps each to a one-line message (``CHORDQ_DEBUG=1``: traceback)."""

from __future__ import annotations

__all__ = ["ChordqError", "InputError", "OutputError", "CheckFailed"]


class ChordqError(Exception):
    """Base class: the message is one line that names the file or tensor and what to do."""

    exit_code = 2


class InputError(ChordqError):
    """The source checkpoint (or an argument) is unusable."""


class OutputError(ChordqError):
    """The output directory cannot be written as asked."""


class CheckFailed(ChordqError):
    """A verification check failed (the input was usable)."""

    exit_code = 1
