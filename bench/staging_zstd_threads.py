#!/usr/bin/env python3
"""Peak RSS and sync time for zstd worker-thread settings (``opguard.staging.sync.zstd_workers``).

    .venv/bin/python bench/staging_zstd_threads.py [--threads 0 1 -1] [--mib 512]

Runs the real CLI with ``sync.zstd_workers`` patched to return ``--threads``: (e) peak RSS of a
256 MiB-payload batch and (a) an uncapped final sync of ``--mib`` MiB of mixed trace data, alternating
settings twice, with ``tar -cf - | zstd -3`` of the same tree after each round. Data from ``staging_bench``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import staging_bench as sb


def cli(threads: int) -> list[str]:
    return [sys.executable, "-c", "import sys; import opguard.staging.sync as s; "
            f"s.zstd_workers = lambda n: {threads}; from opguard.cli import main; "
            "sys.argv = ['opguard'] + sys.argv[1:]; main()"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[0, 1, -1])
    ap.add_argument("--mib", type=int, default=512)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="opguard-zstd-threads-"))
    try:
        e = sb.Workspace(work, "e")
        d = e.rank(0)
        with open(d / "big.bin", "wb") as f:
            for _ in range(128):
                f.write(os.urandom(sb.MiB))
        sb.write_jsonl(d / "trace.jsonl", 128 * sb.MiB, random.Random(3))
        for n in a.threads:
            e.reset_target()
            r = sb.check(sb.run_rss([*cli(n), "sync", "-q"], e.env), "sync")
            print(f"(e) threads={n}: peak RSS {r.maxrss_kib / 1024:.1f} MiB, wall {r.wall:.2f} s, cpu {r.cpu:.2f} s")
        shutil.rmtree(work / "e")
        w = sb.Workspace(work, "a")
        sb.mixed_tree(w, a.mib * sb.MiB)
        for _ in range(2):
            for n in a.threads:
                w.reset_target()
                r = sb.check(sb.run([*cli(n), "sync", "--all", "--final", "-q"], w.env), "sync")
                print(f"(a) threads={n}: wall {r.wall:.2f} s, cpu {r.cpu:.2f} s, load {os.getloadavg()[0]:.1f}")
            b = sb.run_shell_tree(f"tar -cf - -C {w.local} ranks node | zstd -q -3 > {work}/x.tar.zst")
            print(f"(a) tar | zstd -3: wall {b.wall:.2f} s, cpu {b.cpu:.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
