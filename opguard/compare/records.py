"""Normalised operation records: one shape for opguard captures and reference-implementation traces.

A :class:`Record` holds what pairing and the diff need: the call site (function, file, line,
source-line digest), rank, context, and the captured tensor slots. ``site`` is the call-site
identity used for pairing (``docs/compare.md`` §2): ``<file name>:sha=<line digest>#<k>`` when a
source-line digest is known (``k`` the occurrence of that line text in the file, where the source
is available), else ``<file name>:line=<N>``. File and line stay on the record as evidence only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from opguard.errors import ConfigError

COLLECTIVE_PREFIXES = ("torch.distributed.", "dist.", "c10d.", "_c10d_functional.", "torch.ops.c10d")


@dataclass(slots=True, frozen=True)
class Arg:
    """One non-tensor argument of a schema-v2 ``op`` record (docs/capture.md §3): equal iff slot,
    type and value (or digest, for a long value) are equal."""

    slot: str
    type: str
    value: str          # the canonical JSON text of the value, or "sha256:<digest>/<len>"
    digest: bool = False
    # the parameter name of a positional slot ``arg<i>`` (meta.json ``arg_names``, docs/capture.md
    # §3.4): shown, never compared
    label: str | None = field(default=None, compare=False)

    def show(self) -> str:
        """The value as a user reads it: ``'tanh'``, ``1.5``, ``None``, or the digest of a long one."""
        if self.digest:
            return f"<{self.value}>"
        try:
            v = json.loads(self.value)
        except ValueError:
            return self.value
        if self.type == "none":
            return "None"
        if self.type == "float" and v in ("nan", "inf", "-inf"):  # the stored form of a non-finite float
            return str(v)
        if isinstance(v, str) and self.type in ("str", "dtype", "device", "layout", "memory_format", "enum",
                                                "object", "function"):
            return repr(v) if self.type == "str" else v
        if isinstance(v, bool):
            return "True" if v else "False"
        if self.type == "index" and isinstance(v, str):  # x[:, 1:5:2]: the index as Python writes it
            return f"[{v}]"
        if self.type == "range" and isinstance(v, list) and len(v) == 3:
            return f"range({v[0]}, {v[1]}, {v[2]})"
        if self.type == "ndarray" and isinstance(v, dict):   # array([0, 2], dtype=int64)
            what = (_numbers(json.dumps(v["values"])) if "values" in v else
                    f"shape={v.get('shape')}, sha256={v.get('sha256')}")
            return f"array({what}, dtype={v.get('dtype')})"
        if self.type == "slice" and isinstance(v, list) and len(v) == 3:  # x[:80]: slice(None, 80, None)
            return "slice(" + ", ".join("None" if x is None else json.dumps(x) for x in v) + ")"
        return self.value


def _numbers(text: str) -> str:
    """A numeric array's values: its non-finite floats, stored as strings, unquoted."""
    return text.replace('"nan"', "nan").replace('"-inf"', "-inf").replace('"inf"', "inf")


AUTOCAST_SLOT = "(autocast)"  # a capture record's "autocast" field among its arguments (docs/compare.md §4)
GRAD_SLOT = "(grad mode)"     # a capture record's "grad": false among its arguments (absent: on)
_GRAD_OFF = Arg(GRAD_SLOT, "enum", json.dumps("off"))


def slot_label(names: Sequence[str | None], slot: str) -> str | None:
    """The parameter name of a positional slot ``arg<i>`` (None when unknown)."""
    if slot.startswith("arg") and slot[3:].isdigit():
        i = int(slot[3:])
        return names[i] if i < len(names) and isinstance(names[i], str) else None
    return None


def capture_args(raw: Any, names: Sequence[str | None] | None = None) -> tuple[Arg, ...] | None:
    """The ``args`` list of a schema-v2 op record (None when absent); ``names``: the function's
    positional parameter names (meta.json ``arg_names``), the labels of its ``arg<i>`` slots."""
    if raw is None:
        return None
    out = []
    for e in raw:
        slot, typ = str(e["slot"]), str(e["type"])
        label = slot_label(names, slot) if names else None
        if "digest" in e:
            out.append(Arg(slot, typ, f"sha256:{e['digest']}/{e.get('len')}", True, label))
        else:
            out.append(Arg(slot, typ, json.dumps(e.get("value"), sort_keys=True, separators=(",", ":")), False, label))
    return tuple(out)


def arg_changes(a: tuple[Arg, ...] | None, b: tuple[Arg, ...] | None,
                tensors_a: Collection[str] = (), tensors_b: Collection[str] = ()) -> list[str]:
    """What differs between two argument lists, per slot in B's order then A's:
    ``approximate: 'none' -> 'tanh'``, ``alpha: absent -> 1.5``, ``dim: 1 -> absent``, and a
    positional slot with its parameter's name: ``padding (arg4): [1] -> [2]``; a slot that is an
    input tensor on one side (``tensors_a``/``tensors_b``: the input slot names) reads ``a tensor``
    there: ``bias: a tensor -> None``."""
    if a == b:
        return []
    # a positional slot whose parameter name is known is that keyword (torch.clamp(x, 0, 1) and
    # torch.clamp(x, min=0, max=1) pass the same arguments)
    by_a = {_keyword(x): x for x in a or ()}
    by_b = {_keyword(x): x for x in b or ()}
    out = []
    for slot in [*by_a, *(s for s in by_b if s not in by_a)]:
        xa, xb = by_a.get(slot), by_b.get(slot)
        if xa is not None and xb is not None and (xa.type, xa.value, xa.digest) == (xb.type, xb.value, xb.digest):
            continue  # equal but for the slot's form (an Arg's equality includes its slot)
        real = [x.slot for x in (xa, xb) if x is not None]
        slot = next((r for r in real if r != slot), real[0])  # a positional slot as recorded: "min (arg1)"
        # a slot that is a tensor on one side is an input there, not an argument: "a tensor", not "absent"
        absent = "on" if slot == GRAD_SLOT else "absent"
        sa = ("a tensor" if slot in tensors_a else absent) if xa is None else xa.show()
        sb = ("a tensor" if slot in tensors_b else absent) if xb is None else xb.show()
        if xa is not None and xb is not None and xa.type != xb.type:
            sa, sb = f"{sa} ({xa.type})", f"{sb} ({xb.type})"
        label = (xb.label if xb is not None else None) or (xa.label if xa is not None else None)
        out.append(f"{label} ({slot}): {sa} -> {sb}" if label else f"{slot}: {sa} -> {sb}")
    return out


def _keyword(x: Arg) -> str:
    return x.label if x.label and x.slot.startswith("arg") and x.slot[3:].isdigit() else x.slot


@dataclass(slots=True)
class Slot:
    """One captured tensor (or value) of an operation."""

    name: str
    digest: str | None = None
    dtype: str | None = None
    shape: tuple[int | str, ...] | None = None
    device: str | None = None
    stats: dict[str, float] | None = None
    dump: str | None = None           # path of a tensor dump, when one exists
    uninitialized: bool = False       # schema v2: uninitialised memory, its content is never compared
    reason: str | None = None         # why capture recorded no digest (capture's "reason")
    label: str | None = None          # an ``arg<i>`` input without digest: its parameter's name (arg_names)

    def signature(self) -> tuple[Any, ...]:
        return (self.name, self.digest, self.dtype, self.shape, self.uninitialized)


@dataclass(slots=True)
class Record:
    """One operation of one stream, in execution order (``index``)."""

    rank: int
    index: int
    function: str
    site: str
    file: str | None = None
    line: int | None = None
    scope: str | None = None
    line_digest: str | None = None
    context: str = ""
    seq: int | None = None
    step: int | None = None
    collective: bool = False
    inputs: list[Slot] = field(default_factory=list)
    outputs: list[Slot] = field(default_factory=list)
    line_map: str | None = None       # how B's line corresponds to A's (docs/compare.md §2), evidence
    args: tuple[Arg, ...] | None = None   # schema v2: non-tensor arguments, in argument order
    seeded: bool = False              # capture: the call draws random numbers (docs/capture.md §3.1)
    whole_module: bool = False        # capture: a module recorded as one call (api "module", docs/capture.md §3.13)
    error: str | None = None          # capture: the exception the call raised (its text, as recorded)

    def key(self) -> str:
        """The call-site key that order-based pairing compares (rank is equal within a stream)."""
        return f"{self.function}\x00{self.site}\x00{self.context}"

    def line_key(self) -> str:
        """The key by file name and line number, used when a side has no source-line digests."""
        return f"{self.function}\x00{line_site(self.file, self.line, None, None)}\x00{self.context}"

    def anchor_text(self) -> str | None:
        """Captured-input identity for anchors: function + every input slot's digest (None if none)."""
        return anchor_text(self.function, [(s.name, s.digest) for s in self.inputs if s.digest])


def unbracket(function: str) -> str:
    """The reference writes functions as ``<torch.relu>``: drop that one pair of brackets only, so
    ``<torch.distributed.<anonymous>>`` keeps its inner ``<anonymous>``."""
    if function.startswith("<") and function.endswith(">"):
        return function[1:-1]
    return function


def is_collective(function: str) -> bool:
    f = unbracket(function)
    return f.startswith(COLLECTIVE_PREFIXES) or ".distributed." in f


def line_site(file: str | None, line: int | None, digest: str | None, occurrence: int | None) -> str:
    name = os.path.basename(file) if file else "?"
    if digest:
        return f"{name}:sha={digest[:16]}#{occurrence if occurrence is not None else 0}"
    return f"{name}:line={line if line is not None else '?'}"


def stripped_line_digest(text: str) -> str:
    return hashlib.sha256(text.strip().encode("utf-8")).hexdigest()


class SourceCopies:
    """Source files by path (for the line correspondence of docs/compare.md §2); never exported per
    operation. ``rewritten``: the copies are the reference implementation's rewritten sources, whose
    original lines are recovered (§2.1)."""

    def __init__(self, rewritten: bool = False) -> None:
        self._lines: dict[str, list[str] | None] = {}
        self.files: dict[str, Path] = {}
        self.rewritten = rewritten

    def add(self, original: str, copy: Path) -> None:
        self.files.setdefault(original, copy)

    def lines(self, original: str) -> list[str] | None:
        """The lines of the file that ran (None: no copy)."""
        if original not in self._lines:
            copy = self.files.get(original)
            lines: list[str] | None = None
            if copy is not None:
                try:
                    lines = copy.read_text(encoding="utf-8", errors="replace").splitlines()
                except OSError:
                    lines = None
            if lines is not None and self.rewritten:
                from opguard.compare.linemap import recover_original

                lines = recover_original(lines)
            self._lines[original] = lines
        return self._lines[original]

    def line_digest(self, file: str, line: int) -> str | None:
        """SHA-256 of the stripped text of a line of the file that ran (evidence), None if unknown."""
        lines = self.lines(file)
        if lines is None or not 1 <= line <= len(lines):
            return None
        return stripped_line_digest(lines[line - 1])


# ---- opguard capture records (docs/capture.md, trace schema version 1) ----------------------------

CAPTURE_VERSION = 2            # the newest capture trace schema this opguard reads (1 and 2)
CAPTURE_VERSIONS = (1, 2)
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def _shape(v: Any) -> tuple[int | str, ...] | None:
    """A shape: sizes, a symbolic one as its text (a nested tensor's ragged ``j1``, capture §3.3)."""
    if v.__class__ is list and all(x.__class__ is int or x.__class__ is str for x in v):
        return tuple(v)
    return None


def capture_stats(v: Any) -> dict[str, float] | None:
    if not isinstance(v, Mapping):
        return None
    try:
        return {k: float(x) for k, x in v.items()}      # numbers, or "nan"/"inf"/"-inf" (docs/capture.md §3)
    except (TypeError, ValueError):
        pass
    out: dict[str, float] = {}
    for k, x in v.items():
        if (isinstance(x, int | float) and not isinstance(x, bool)) or x in ("nan", "inf", "-inf"):
            out[str(k)] = float(x)
    return out


def _str(v: Any) -> str | None:
    return v if v.__class__ is str else None


def capture_slot(raw: Mapping[str, Any], default_name: str) -> Slot:
    stats = raw.get("stats")
    return Slot(str(raw.get("slot", default_name)), _str(raw.get("digest")), _str(raw.get("dtype")),
                _shape(raw.get("shape")), _str(raw.get("device")), None if stats is None else capture_stats(stats),
                uninitialized=raw.get("uninitialized") is True, reason=_str(raw.get("reason")))


def capture_context(obj: Mapping[str, Any]) -> str:
    """Module path, user context and (for backward aten ops) the phase: part of the pairing key."""
    parts = [str(obj.get("module") or "-"), str(obj.get("context") or "")]
    if obj.get("phase") == "backward":
        parts.append("backward")
    return "|".join(parts)


@dataclass(slots=True, frozen=True)
class RecordSite:
    """Everything a capture record's call-site fields determine (computed once per distinct site)."""

    function: str
    file: str | None
    line: int | None
    scope: str | None
    line_digest: str | None
    site: str
    context: str
    collective: bool
    key: str
    line_key: str
    line_map: str | None = None


class SiteCache:
    """Call sites of capture records by their raw fields: identity work once per distinct site."""

    def __init__(self, sources: SourceCopies | None) -> None:
        self.sources = sources
        self._sites: dict[tuple[Any, ...], RecordSite] = {}

    def get(self, obj: Mapping[str, Any]) -> RecordSite:
        raw = (obj["fn"], obj.get("file"), obj.get("line"), obj.get("src"), obj.get("func"), obj.get("module"),
               obj.get("context"), obj.get("phase"), obj.get("api"))
        site = self._sites.get(raw)
        if site is None:
            site = self._sites[raw] = self._make(obj)
        return site

    def _make(self, obj: Mapping[str, Any]) -> RecordSite:
        file = obj.get("file")
        line = obj.get("line")
        digest = obj.get("src")
        if digest == EMPTY_SHA256 or not isinstance(digest, str):
            digest = None            # the source line was unavailable when captured
        function = str(obj["fn"])
        ident = line_site(file, line, None, None)      # provisional: linemap.assign_identities decides
        context = capture_context(obj)
        key = f"{function}\x00{ident}\x00{context}"
        return RecordSite(function, file, line, obj.get("func"), digest, ident, context,
                    obj.get("api") == "collective" or is_collective(function), key, key)


def anchor_text(function: str, pairs: list[tuple[str, str]]) -> str | None:
    """Captured-input identity for anchors: function + every input slot's digest (None if none)."""
    if not pairs:
        return None
    return function + "\x00" + "\x00".join(f"{n}={d}" for n, d in pairs)


def capture_index_fields(obj: Mapping[str, Any], sites: SiteCache) -> tuple[RecordSite, str | None]:
    """What pairing needs of a capture op record, without building its slots."""
    site = sites.get(obj)
    pairs = []
    for i, s in enumerate(obj.get("inputs") or ()):
        d = s.get("digest")
        if d:
            pairs.append((str(s.get("slot", f"in{i}")), d))
    return site, anchor_text(site.function, pairs)


_ADDRESS = re.compile(r"\[?\b\d{1,3}(?:\.\d{1,3}){3}\]?:\d+|\[[0-9a-fA-F:]*:[0-9a-fA-F:]*\]:\d+|\b0x[0-9a-fA-F]{6,}\b"
                      r"|\bpid \d+|\b(?:port|pid)[ =]\d+")


def error_key(text: str) -> str:
    """A recorded error's message as compared: socket addresses (``[127.0.0.1]:45993``), object
    addresses (``0x7f3a...``) and process ids or ports named so, which differ between identical runs
    (a peer's ephemeral port in gloo's "Connection closed by peer"), read as ``<addr>``/``<id>``."""
    return _ADDRESS.sub(lambda m: "<id>" if m.group(0)[:1] in "pP" else "<addr>", text)


def from_capture(obj: Mapping[str, Any], index: int, sites: SiteCache, where: str,
                 arg_names: Mapping[str, Sequence[str | None]] | None = None) -> Record:
    """An ``op`` record of docs/capture.md §3.1 as a :class:`Record`; ``arg_names``: the run's
    meta.json ``arg_names`` (labels of positional argument slots)."""
    try:
        site = sites.get(obj)
        inputs = [capture_slot(s, f"in{i}") for i, s in enumerate(obj.get("inputs") or ())]
        outputs = [capture_slot(s, f"out{i}") for i, s in enumerate(obj.get("outputs") or ())]
        if obj.get("error"):
            outputs.append(Slot(name="error", digest=error_key(str(obj["error"]))))
        names = arg_names.get(obj["fn"]) if arg_names else None
        args = capture_args(obj.get("args"), names)
        if names:
            for s in inputs:
                if s.digest is None:  # named where compare may say it was not recorded (diff._unseen)
                    s.label = slot_label(names, s.name)
        autocast = obj.get("autocast")
        if autocast is not None:  # the autocast state the call ran under, compared as an argument is
            args = (*(args or ()), Arg(AUTOCAST_SLOT, "str", json.dumps(str(autocast))))
        if obj.get("grad") is False:  # grad mode off (no_grad, inference_mode): compared as an argument is
            args = (*(args or ()), _GRAD_OFF)
        return Record(obj["rank"], index, site.function, site.site, site.file, site.line, site.scope,
                      site.line_digest, site.context, obj.get("seq"), obj.get("step"), site.collective,
                      inputs, outputs, site.line_map, args, obj.get("seeded") is True, obj.get("api") == "module",
                      str(obj["error"]) if obj.get("error") else None)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"{where}: not an opguard capture op record ({type(e).__name__}: {e})",
                          "pass a trace directory written by opguard capture (docs/capture.md)") from None


# ---- reference implementation (opguard 0.1.0) records -------------------------------------------

def _ref_slots(value: Any, path: str, out: list[Slot]) -> None:
    if isinstance(value, Mapping):
        stats = value.get("stats")
        if isinstance(stats, Mapping) or "shape" in value:
            stats = stats if isinstance(stats, Mapping) else {}
            sig = stats.get("xor_signature")
            digest = None
            if isinstance(sig, list):
                digest = "xor:" + ",".join(str(x) for x in sig)
            elif sig is not None:
                digest = f"xor:{sig}"
            numeric = {k: float(v) for k, v in stats.items()
                       if isinstance(v, int | float) and not isinstance(v, bool) and k != "numel"}
            out.append(Slot(name=path, digest=digest, dtype=stats.get("dtype"), shape=_shape(value.get("shape")),
                            device=stats.get("device"), stats=numeric or None))
            return
        for k, v in value.items():
            _ref_slots(v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _ref_slots(v, f"{path}[{i}]", out)


def reference_file(obj: Mapping[str, Any], line: int | None) -> str | None:
    """A reference record's call-site file (docs/compare.md §2.1): ``fname`` when it is a file path,
    else the ``stack_trace`` frame at ``line_num`` (the first frame if none is), else the only key of
    ``source_files`` (with several keys, the others are files like torch's ``module.py``)."""
    files = obj.get("source_files")
    fname = obj.get("fname")
    if isinstance(fname, str) and (fname.endswith(".py") or (isinstance(files, Mapping) and fname in files)):
        return fname
    st = obj.get("stack_trace")
    if isinstance(st, str) and st.strip():
        frames: list[tuple[str, int]] = []
        for text in st.strip().splitlines():
            head = text.split(" in ", 1)[0]
            path, _, num = head.rpartition(":")
            if path and num.isdigit():
                frames.append((path, int(num)))
        for path, at in frames:
            if at == line:
                return path
        if frames:
            return frames[0][0]
    if isinstance(files, Mapping) and len(files) == 1:
        return str(next(iter(files)))
    return None


def from_reference(obj: Mapping[str, Any], sources: SourceCopies | None, where: str) -> Record:
    """A reference trace record (``counter``, ``function``, ``inputs``/``outputs``, ``gpu_rank``)."""
    try:
        function = unbracket(str(obj["function"]))
        line = obj.get("line_num")
        line = line if isinstance(line, int) else None
        file = reference_file(obj, line)
        digest = None
        if sources is not None and file and line is not None:
            digest = sources.line_digest(file, line)
        inputs: list[Slot] = []
        raw_in = obj.get("inputs") or {}
        if isinstance(raw_in, Mapping):
            _ref_slots(raw_in.get("self"), "self", inputs)
            _ref_slots(raw_in.get("args"), "args", inputs)
            _ref_slots(raw_in.get("kwargs"), "kwargs", inputs)
        outputs: list[Slot] = []
        _ref_slots(obj.get("outputs"), "out", outputs)
        return Record(
            rank=int(obj["gpu_rank"]), index=-1, function=function, site=line_site(file, line, None, None),
            file=file, line=line, line_digest=digest, seq=int(obj["counter"]), collective=is_collective(function),
            inputs=inputs, outputs=outputs)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: not a reference trace record ({type(e).__name__}: {e})",
                          "pass an exec_trace directory written by the reference implementation") from None


def loads(line: bytes) -> Any:
    """One JSON value: orjson, or the standard library for what orjson refuses (``NaN`` literals,
    integers beyond 64 bits, lone surrogates), so both accept the same input and raise ValueError."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        try:
            return json.loads(line)
        except RecursionError:  # nested deeper than any record (orjson refuses past 1024 levels too)
            raise ValueError("JSON nested too deeply") from None


def jsonl_where(path: Path, n: int, offset: int, start: int) -> str:
    """How a record is named in messages: ``path:line`` (``path@offset`` when read from the middle)."""
    return f"{path}:{n}" if start == 0 else f"{path}@{offset}"


def bad_line(path: Path, n: int, offset: int, start: int, error: ValueError | None) -> ConfigError:
    """The error for a line that is not a JSON object (``error``: the parser's, if it did not parse)."""
    if error is None:
        return ConfigError(f"{path}@{offset}: a record must be a JSON object", "repair or remove the line")
    return ConfigError(f"{jsonl_where(path, n, offset, start)}: not a JSON record ({error})",
                       "repair or remove the damaged line; compare reads only complete records")


def iter_jsonl(path: Path, start: int = 0) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(line number, byte offset, object) for every complete record of a JSON-lines file from
    ``start`` (name it with :func:`jsonl_where`). A bad line is an error; blank lines are skipped;
    an incomplete trailing record (still being written) ends the file."""
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        n = 0
        for line in f:
            n += 1
            here = offset
            offset += len(line)
            if line[-1:] != b"\n":
                break
            try:
                obj = loads(line)
            except ValueError as e:
                if not line.strip():
                    continue
                raise bad_line(path, n, here, start, e) from None
            if obj.__class__ is not dict:
                raise bad_line(path, n, here, start, None)
            yield n, here, obj
