"""Validation of every name a reader takes from a target (``docs/format.md`` §2, §7, §11).

One function per kind of name. Every reader (format 2, reference v1, legacy snapshots) calls
them on a name *before* it reaches any filesystem call; a violation raises
:class:`~opguard.errors.IntegrityError` (exit 5) naming the field and the rule, and the reader
prefixes the stream and the batch. Values are shown shortened: a hostile name can be megabytes.

Limits (``docs/format.md`` §11): a path component is at most ``NAME_MAX`` (255) bytes and a
path at most ``PATH_MAX - 1`` (4095) bytes once encoded as the file system sees it (UTF-8 with
surrogate escapes): a producer reads its files through absolute paths of at most that length,
so nothing longer can have been published by opguard. Depth follows (at most 2048 levels).
"""

from __future__ import annotations

import os
import re

from opguard.errors import IntegrityError
from opguard.staging.layout import NODE_STREAM_PREFIX, RANK_STREAM_PREFIX, rank_stream

NAME_MAX = 255
PATH_MAX = 4096
ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_RANK_STREAM = re.compile(re.escape(RANK_STREAM_PREFIX) + r"([0-9]{6,})")
_SHOWN = 80
_FIX = ("the target was not written by opguard, or was altered by someone with write access to it; "
        "do not restore it by hand")


def show(value: object) -> str:
    """``repr`` of ``value``, shortened to a readable length."""
    text = repr(value)
    if len(text) <= _SHOWN:
        return text
    return f"{text[:_SHOWN]}... ({len(text)} characters)"


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(32), 127)} | {0x85: "\\x85", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def printable(value: object, limit: int = 200) -> str:
    """A value read from a file others can write, for one line of a report: ``str`` with control
    characters escaped (a value holding a newline cannot print a line of its own), at most
    ``limit`` characters."""
    text = str(value).translate(_CONTROL)
    return text if len(text) <= limit else text[:limit] + "..."


def _refuse(field: str, value: object, rule: str) -> IntegrityError:
    return IntegrityError(f"{field} {show(value)} is not {rule}", _FIX)


def _unsafe(field: str, value: str, why: str) -> IntegrityError:
    return IntegrityError(f"{field} {show(value)} is an unsafe path ({why}): refused", _FIX)


def identifier(value: object, field: str, what: str = "a node ID") -> str:
    """A node or run ID (§2): 1-128 characters from ``[A-Za-z0-9._-]``, not starting with ``.``."""
    if not isinstance(value, str) or not ID_RE.fullmatch(value):
        raise _refuse(field, value, f"{what} (1-128 characters from [A-Za-z0-9._-], not starting with '.')")
    return value


def node_id(value: object, field: str) -> str:
    return identifier(value, field, "a node ID")


def run_id(value: object, field: str) -> str:
    return identifier(value, field, "a run ID")


def parse_stream(value: object) -> tuple[str, int | None, str | None] | None:
    """The one parser of stream IDs and rank directory names (§2, §3): ``rank-<R:06d>`` (the
    canonical spelling only) or ``node-<node ID>``; (kind, rank, node ID), or None for anything else."""
    if isinstance(value, str):
        m = _RANK_STREAM.fullmatch(value)
        if m and rank_stream(int(m.group(1))) == value:
            return "rank", int(m.group(1)), None
        node = value.removeprefix(NODE_STREAM_PREFIX)
        if node != value and ID_RE.fullmatch(node):
            return "node", None, node
    return None


def parse_rank_stream(value: object) -> int | None:
    """The rank of a rank stream ID / rank directory name, else None."""
    parsed = parse_stream(value)
    return parsed[1] if parsed is not None and parsed[0] == "rank" else None


def stream(value: object, field: str) -> tuple[str, int | None, str | None]:
    """A stream ID (§2): ``rank-<R:06d>`` or ``node-<node ID>``; returns (kind, rank, node ID)."""
    parsed = parse_stream(value)
    if parsed is None:
        raise _refuse(field, value, "a stream ID (rank-<R, 6+ digits> or node-<node ID>)")
    return parsed


def relpath(value: object, field: str) -> str:
    """A relative path under a restore root (§7): entry paths, legacy member names, v1 paths.

    Not empty, not absolute; no empty, ``.`` or ``..`` component; no ``\\`` or NUL; each component
    at most NAME_MAX bytes and the whole at most PATH_MAX - 1 bytes as the file system sees them.
    """
    if not isinstance(value, str):
        raise IntegrityError(f"{field} is {show(value)}, not a path (a JSON string)", _FIX)
    if not value or value.startswith("/"):
        raise _unsafe(field, value, "absolute or empty")
    if "\\" in value or "\0" in value:
        raise _unsafe(field, value, "it holds '\\' or NUL")
    try:
        encoded = os.fsencode(value)
    except UnicodeError:
        raise _unsafe(field, value, "not encodable as a file name") from None
    if len(encoded) > PATH_MAX - 1:
        raise _unsafe(field, value, f"{len(encoded)} bytes, more than PATH_MAX - 1 = {PATH_MAX - 1}")
    for part in encoded.split(b"/"):
        if part in (b"", b".", b".."):
            raise _unsafe(field, value, "'..', '.' or empty components")
        if len(part) > NAME_MAX:
            raise _unsafe(field, value, f"a component of {len(part)} bytes, more than NAME_MAX = {NAME_MAX}")
    return value
