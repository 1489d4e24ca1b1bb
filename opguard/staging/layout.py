"""Where every file lives (``docs/format.md`` §3–§5). Pure path arithmetic, no I/O."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from opguard.errors import ConfigError
from opguard.staging.config import StagingConfig

# Every on-disk name is spelled here once (``docs/format.md`` §3-§6); readers and writers import it.
# the logical layout (output base, node-local base, restored tree; §3, §4)
RANKS_DIRNAME = "ranks"
NODES_DIRNAME = "nodes"
NODE_COPY_DIRNAME = "_node"
WRITER_TMP_PREFIX = ".opguard-tmp-"
# the shared target (§5): .opguard-bundles/{format.json, nodes/<node ID>.json, streams/<stream>/}
BUNDLES_DIRNAME = ".opguard-bundles"
FORMAT_FILE = "format.json"
CLAIMS_DIRNAME = "nodes"
STREAMS_DIRNAME = "streams"
TARGET_TMP_PREFIX = ".tmp-"
# the uploader's local state (§4, §6): state/streams/<stream>/{checkpoint.json, pending.json}
STATE_DIRNAME = "state"
# the legacy format read, never written (§9)
SNAPSHOT_NAME = "sync.tar.gz"
# a rank's capture files (``docs/capture.md`` §2): written by capture, read by compare, checked by
# opguard-run; here because staging is the lowest layer all three import
CAPTURE_DIRNAME = "capture"
CAPTURE_META_FILE = "meta.json"
CAPTURE_TRACE_FILE = "trace.jsonl"
CAPTURE_CALLSITES_FILE = "callsites.json"
CAPTURE_SOURCES_FILE = "sources.json"
# a restarted attempt's capture (torchrun --max-restarts: TORCHELASTIC_RESTART_COUNT=k > 0) beside it
CAPTURE_RESTART_PREFIX = CAPTURE_DIRNAME + ".restart-"


def capture_dirname(restart: int) -> str:
    """The capture directory of a rank's attempt ``restart`` (0: the first attempt)."""
    return CAPTURE_DIRNAME if restart <= 0 else f"{CAPTURE_RESTART_PREFIX}{restart}"


def parse_capture_dirname(name: str) -> int | None:
    """The attempt a capture directory name belongs to (:func:`capture_dirname`'s inverse), or None."""
    if name == CAPTURE_DIRNAME:
        return 0
    rest = name[len(CAPTURE_RESTART_PREFIX):] if name.startswith(CAPTURE_RESTART_PREFIX) else ""
    if rest.isascii() and rest.isdigit() and not rest.startswith("0") and len(rest) <= 9:
        return int(rest)
    return None


def capture_dump_slot(slot: str, output: bool) -> str:
    """The slot a capture tensor dump is named and recorded by (docs/capture.md §7), so an input's and
    an output's never collide: an output's own when it starts with ``out``, else ``out.<slot>`` (an
    output named like the input it wrote, ``self`` or ``arg1``); an input's own, except ``in.<slot>``
    when it starts with ``out`` (an ``out=`` argument: its value before the call)."""
    if output:
        return slot if slot.startswith("out") else f"out.{slot}"
    return f"in.{slot}" if slot.startswith("out") else slot
# stream IDs (§2): rank-<R:06d> and node-<node ID>; parsed by ``names.parse_stream``
RANK_STREAM_PREFIX = "rank-"
NODE_STREAM_PREFIX = "node-"


def rank_stream(rank: int) -> str:
    return f"{RANK_STREAM_PREFIX}{rank:06d}"


def rank_dirname(rank: int) -> str:
    """A rank's directory under ``ranks/``: its stream ID (§3)."""
    return rank_stream(rank)


def node_stream(node_id: str) -> str:
    return f"{NODE_STREAM_PREFIX}{node_id}"


def current_rank(env: Mapping[str, str] | None = None) -> int:
    """The global rank of this process (0 for a lone process): ``identity.process_identity``, the
    resolver the launcher uses too (``docs/launcher.md`` §1)."""
    from opguard.staging.identity import process_identity

    return process_identity(env).rank


def current_node_id(config: StagingConfig, env: Mapping[str, str] | None = None) -> str:
    """OPGUARD_NODE_ID, else the scheduler's node name when Slurm describes this process (an srun
    task), else the short hostname; validated (``docs/launcher.md`` §1, the launcher's rule)."""
    from opguard.staging.identity import read_environment

    if config.node_id:
        return config.node_id
    seen = read_environment({k: v for k, v in (os.environ if env is None else env).items() if k != "OPGUARD_NODE_ID"})
    if seen.node_id_error is not None:
        raise seen.node_id_error
    return seen.node_id


@dataclass(frozen=True)
class Layout:
    """All paths of one process's view of the run."""

    config: StagingConfig

    # ---- producers' side -------------------------------------------------------------------
    def _root(self) -> Path:
        if self.config.enabled:
            assert self.config.local_base is not None
            return self.config.local_base
        if self.config.output_base is None:
            raise ConfigError("OPGUARD_TRACE_OUTPUT_BASE is not set", "export OPGUARD_TRACE_OUTPUT_BASE=/absolute/path")
        return self.config.output_base

    def rank_dir(self, rank: int) -> Path:
        return self._root() / RANKS_DIRNAME / rank_dirname(rank)

    def node_dir(self, node_id: str) -> Path:
        if self.config.enabled:
            return self._root() / "node"
        return self._root() / NODES_DIRNAME / node_id

    # ---- uploader state (staging only) -----------------------------------------------------
    @property
    def state_dir(self) -> Path | None:
        if not self.config.enabled:
            return None
        return self._root() / STATE_DIRNAME

    def _state(self) -> Path:
        sd = self.state_dir
        if sd is None:
            raise ConfigError("local staging is not enabled", "export OPGUARD_LOCAL_DUMP_ENABLED=1")
        return sd

    @property
    def run_file(self) -> Path:
        return self._state() / "run.json"

    @property
    def locks_dir(self) -> Path:
        return self._state() / "locks"

    def stream_lock(self, stream: str) -> Path:
        return self.locks_dir / f"stream-{stream}.lock"

    @property
    def node_upload_lock(self) -> Path:
        return self.locks_dir / "node-upload.lock"

    @property
    def node_duty_lock(self) -> Path:
        return self.locks_dir / "node-duty.lock"

    @property
    def run_lock(self) -> Path:
        """Held while ``run.json`` is created and while its orphaned temporaries are removed."""
        return self.locks_dir / "run.lock"

    def stream_state_dir(self, stream: str) -> Path:
        return self._state() / STREAMS_DIRNAME / stream

    # ---- shared target ---------------------------------------------------------------------
    @property
    def bundles_dir(self) -> Path | None:
        if not self.config.enabled or self.config.target is None:
            return None
        return self.config.target / BUNDLES_DIRNAME

    def as_dict(self, rank: int, node_id: str) -> dict[str, object]:
        bd = self.bundles_dir
        sd = self.state_dir
        return {
            "rank": rank,
            "node_id": node_id,
            "run_id": self.config.run_id,
            "staging_enabled": self.config.enabled,
            "rank_dir": str(self.rank_dir(rank)),
            "node_dir": str(self.node_dir(node_id)),
            "state_dir": str(sd) if sd else None,
            "target": str(self.config.target) if self.config.target else None,
            "bundles_dir": str(bd) if bd else None,
            "output_base": str(self.config.output_base) if self.config.output_base else None,
            "local_base": str(self.config.local_base) if self.config.local_base else None,
            "rank_stream": rank_stream(rank),
            "node_stream": node_stream(node_id),
        }

# a source file copied into the node metadata (launcher/nodeinfo.py) or read by compare (compare/sources.py)
SOURCE_COPY_MAX_BYTES = 4 << 20
