"""Error types shared by every layer, each with a distinct exit status.

Every error carries what happened *and* what to do about it; the CLI prints both to stderr
and exits with the error's status. Statuses:

0 success · 1 unexpected internal error · 2 configuration / usage / preflight problem ·
3 a local lock could not be taken in time · 4 an I/O failure while publishing (the batch is
kept for retry) · 5 integrity failure (damaged, missing or unsealed data) · 6 identity or
version refusal (another run, a lost checkpoint, a legacy or newer format).
"""

from __future__ import annotations


class OpguardError(Exception):
    """Base class: ``message`` says what happened, ``fix`` what to do."""

    exit_code = 1

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        if self.fix:
            return f"{self.message}\n  fix: {self.fix}"
        return self.message


class ConfigError(OpguardError):
    """A bad environment variable, path or argument, found before any work started."""

    exit_code = 2


class LockTimeout(OpguardError):
    """A local lock was held by someone else for longer than the timeout."""

    exit_code = 3


class PublishError(OpguardError):
    """Publishing a batch failed; the batch is retained locally for the next sync."""

    exit_code = 4


class IntegrityError(OpguardError):
    """Published data is damaged, missing or (when required) unsealed."""

    exit_code = 5


class IdentityError(OpguardError):
    """Run, stream, node or format identity disagrees with what is already recorded."""

    exit_code = 6
