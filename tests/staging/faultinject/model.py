"""A producer model: several ranks and a node writing a realistic trace tree, plus what a restore must give.

Every JSON-lines record carries a unique ``id``, so a lost or duplicated record is visible. The
model writes real files with the real producer API (``write_file_atomic``) and by hand (partial
trailing records, rotation by rename and by truncation, in-place rewrites, deletions). It never
writes while a sync runs, so the expected restore is exactly the producers' final tree:
complete records of every JSON-lines file, whole content of every other file; a deleted path may
be absent or hold one of the contents it had (whether it was published before the deletion is
up to the timing of syncs and crashes).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from opguard.staging.writers import is_jsonl, write_file_atomic


def complete(data: bytes) -> bytes:
    """The complete records of JSON-lines content (what a restore can hold)."""
    return data[: data.rfind(b"\n") + 1]


def records(data: bytes) -> list[int]:
    return [json.loads(line)["id"] for line in data.splitlines()]


@dataclass
class Producer:
    """One stream's producer (a rank, or the node's metadata when ``node`` is true)."""

    root: Path
    rng: random.Random
    node: bool = False
    ids: list[int] = field(default_factory=lambda: [0])  # shared counter across producers
    history: dict[str, list[bytes]] = field(default_factory=dict)  # deleted path -> contents it had
    rotations: int = 0
    rest: dict[str, bytes] = field(default_factory=dict)  # log -> rest of its partial trailing record

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def record(self, pad: int | None = None) -> bytes:
        self.ids[0] += 1
        n = self.rng.randrange(0, 400) if pad is None else pad
        return json.dumps({"id": self.ids[0], "pad": "x" * n}, separators=(",", ":")).encode() + b"\n"

    def _remember(self, rel: str) -> None:
        p = self.root / rel
        if p.is_file():
            self.history.setdefault(rel, []).append(p.read_bytes())

    # ---- operations ---------------------------------------------------------------------------------

    def append(self, log: str = "trace.jsonl") -> None:
        """Append whole records; half the time end in a partial record (its rest comes later)."""
        p = self.root / log
        if self.rest.get(log) and p.exists():
            return self.finish_partial(log)
        with open(p, "ab") as f:
            for _ in range(self.rng.randrange(1, 60)):
                f.write(self.record())
            if self.rng.random() < 0.5:
                rec = self.record()
                cut = self.rng.randrange(1, len(rec))
                f.write(rec[:cut])
                self.rest[log] = rec[cut:]
        return None

    def finish_partial(self, log: str = "trace.jsonl") -> None:
        """Write the rest of a partial trailing record (a record written in two writes)."""
        rest = self.rest.pop(log, b"")
        if rest and (self.root / log).exists():
            with open(self.root / log, "ab") as f:
                f.write(rest)

    def rotate_rename(self, log: str = "trace.jsonl") -> None:
        p = self.root / log
        if p.exists():
            self.rotations += 1
            self._remember(log)  # if no record follows, the restore holds its last published version
            os.rename(p, self.root / f"{log[:-6]}.r{self.rotations}.jsonl")
            self.rest.pop(log, None)  # the renamed segment keeps its partial record forever

    def rotate_truncate(self, log: str = "trace.jsonl") -> None:
        p = self.root / log
        if p.exists():
            self._remember(log)
            self.rest.pop(log, None)
            with open(p, "r+b") as f:
                f.truncate(0)
                if self.rng.random() < 0.7:
                    f.write(self.record())

    def tensor(self) -> None:
        rel = f"tensors/t{self.rng.randrange(5)}.pt"
        self._remember(rel)
        write_file_atomic(self.root / rel, self.rng.randbytes(self.rng.randrange(0, 40_000)))

    def rewrite_in_place(self) -> None:
        p = self.root / "meta.txt"
        self._remember("meta.txt")
        with open(p, "wb") as f:  # same inode, new content (between syncs)
            f.write(self.rng.randbytes(self.rng.randrange(1, 200)))

    def delete(self) -> None:
        victims = sorted(q.relative_to(self.root).as_posix() for q in self.root.rglob("*")
                         if q.is_file() and (q.suffix == ".pt" or ".r" in q.name))
        if victims:
            rel = self.rng.choice(victims)
            self._remember(rel)
            (self.root / rel).unlink()

    def step(self) -> None:
        if self.node:  # node metadata: whole files replaced atomically, one growing log
            if self.rng.random() < 0.5:
                write_file_atomic(self.root / f"meta/m{self.rng.randrange(3)}.json",
                                  json.dumps({"v": self.rng.random()}).encode())
            else:
                with open(self.root / "events.jsonl", "ab") as f:
                    f.write(self.record(pad=10))
            return
        r = self.rng.random()
        if r < 0.40:
            self.append()
        elif r < 0.50:
            self.finish_partial()
        elif r < 0.58:
            self.rotate_rename()
        elif r < 0.64:
            self.rotate_truncate()
        elif r < 0.80:
            self.tensor()
        elif r < 0.90:
            self.rewrite_in_place()
        else:
            self.delete()

    # ---- expectations -------------------------------------------------------------------------------

    def current(self) -> dict[str, bytes]:
        """path -> what a restore must hold for every file that exists now."""
        out: dict[str, bytes] = {}
        for q in sorted(self.root.rglob("*")):
            if q.is_file() and not q.name.startswith(".opguard-tmp-"):
                rel = q.relative_to(self.root).as_posix()
                data = q.read_bytes()
                out[rel] = complete(data) if is_jsonl(rel) else data
        return out

    def check_restored(self, got: dict[str, bytes]) -> None:
        """Compare a restored tree (``_node/`` excluded) with the producer's tree; explain a difference."""
        want = self.current()
        for rel, data in want.items():
            assert rel in got, f"{self.root.name}/{rel} missing from the restore"
            if got[rel] != data:
                msg = f"{self.root.name}/{rel} differs: {len(got[rel])} restored bytes, {len(data)} expected"
                if is_jsonl(rel):
                    g, w = records(got[rel]), records(data)
                    lost, dup = sorted(set(w) - set(g)), len(g) - len(set(g))
                    msg += f"; records lost: {lost[:10]} ({len(lost)}), duplicated: {dup}"
                raise AssertionError(msg)
        for rel in sorted(set(got) - set(want)):
            old = self.history.get(rel)
            assert old is not None, f"{self.root.name}/{rel} restored but never written"
            if is_jsonl(rel):
                ok = any(got[rel] == complete(h) or (h.startswith(got[rel]) and got[rel].endswith(b"\n"))
                         or got[rel] == b"" for h in old)
            else:
                ok = got[rel] in old
            assert ok, f"deleted {self.root.name}/{rel} restored with content it never had"
