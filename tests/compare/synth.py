"""Capture-schema (docs/capture.md v1 and v2) trace writers for tests and the benchmark.

These write records in the documented schema directly; tests over real captures use
opguard.capture itself (test_real_capture.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def digest_of(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def src_of(text: str) -> str:
    return hashlib.sha256(text.strip().encode()).hexdigest()


def op(seq: int, fn: str, line: int, text: str, inputs: list[str], outputs: list[str], *, rank: int = 0,
       step: int = 0, file: str = "/work/train.py", module: str | None = None, api: str = "function",
       stats: dict[str, Any] | None = None) -> dict[str, Any]:
    st = stats or {"min": -1.0, "max": 1.0, "mean": 0.0, "std": 0.5, "absmax": 1.0, "nan": 0, "inf": 0}
    return {"v": 1, "kind": "op", "seq": seq, "step": step, "rank": rank, "api": api, "fn": fn, "file": file,
            "line": line, "func": "<module>", "src": src_of(text), "site": 0, "module": module, "context": None,
            "depth": 0, "parent": None, "phase": "forward",
            "inputs": [{"slot": f"arg{i}", "dtype": "float32", "shape": [4, 4], "device": "cpu", "digest": d}
                       for i, d in enumerate(inputs)],
            "outputs": [{"slot": "out" if len(outputs) == 1 else f"out.{i}", "dtype": "float32", "shape": [4, 4],
                         "device": "cpu", "digest": d, "stats": st} for i, d in enumerate(outputs)]}


def write_rank(base: Path, rank: int, records: Iterable[dict[str, Any]], *, end: bool = True, version: int = 1,
               meta: dict[str, Any] | None = None) -> Path:
    """One rank's capture directory; ``version=2`` writes schema v2 (meta.json and every record's ``v``)."""
    cap = base / "ranks" / f"rank-{rank:06d}" / "capture"
    cap.mkdir(parents=True, exist_ok=True)
    (cap / "meta.json").write_text(json.dumps({"schema": "opguard-capture", "version": version, "rank": rank,
                                               **(meta or {})}))
    n = 0
    with open(cap / "trace.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(dict(r, v=version)) + "\n")
            n += 1
        if end:
            f.write(json.dumps({"v": version, "kind": "end", "rank": rank, "records": n, "cap_reached": False})
                    + "\n")
    return cap


def arg(slot: str, typ: str, value: Any) -> dict[str, Any]:
    """A schema-v2 ``args`` entry (docs/capture.md §3; the contract's 64-character digest rule)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    if len(text) > 64:
        return {"slot": slot, "type": typ, "digest": hashlib.sha256(text.encode()).hexdigest()[:16], "len": len(text)}
    return {"slot": slot, "type": typ, "value": value}


def program(variant: str = "base", rank: int = 0) -> list[dict[str, Any]]:
    """A tiny program as records: draws, matmuls, an add, a sum (mirrors the reference scenarios)."""
    x, y, w = (digest_of(rank, n) for n in "xyw")
    h = digest_of("mm", x, w)
    r = digest_of("relu", h)
    g = digest_of("mm", y, w)
    s = digest_of("add", r, g, variant == "numeric")
    loss = digest_of("sum", s)
    lines = [
        ("torch.randn", 10, "x = torch.randn(4, 4)", [], [x]),
        ("torch.randn", 11, "y = torch.randn(4, 4)", [], [y]),
        ("torch.randn", 12, "w = torch.randn(4, 4)", [], [w]),
        ("torch.matmul", 13, "h = torch.matmul(x, w)", [x, w], [h]),
        ("torch.relu", 14, "h = torch.relu(h)", [h], [r]),
        ("torch.matmul", 15, "g = torch.matmul(y, w)", [y, w], [g]),
        ("torch.add", 16, "s = torch.add(h, g)", [r, g], [s]),
        ("torch.sum", 17, "loss = torch.sum(s)", [s], [loss]),
    ]
    return [op(i, fn, line, text, ins, outs, rank=rank) for i, (fn, line, text, ins, outs) in enumerate(lines)]
