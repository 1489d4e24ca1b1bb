"""Compare two captured runs: call correspondence, diffs, a Perfetto view and align (docs/compare.md).

Layer: CLI-facing library; imports staging (restore) but never the launcher or the CLI, and never
torch at module import (tensor dumps load lazily in :mod:`opguard.compare.diff`).
"""
