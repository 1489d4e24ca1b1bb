"""The uploader never follows a link planted on the shared target (issue 14; docs/format.md §11).

Another user of the target plants ``.opguard-bundles/streams/rank-000000`` (or ``streams``) as a
symbolic link to a directory of their choosing before the first sync. The run's batches and seal
must not go there: the sync refuses (exit 6) and names the link. Real ``opguard sync``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from opguard.staging.writers import write_file_atomic
from tests.helpers.sync import opguard, rank_dir, stream_dir


@pytest.mark.parametrize("where", ["stream", "streams"])
def test_a_planted_stream_link_is_not_followed_by_the_uploader(staging_env: dict[str, str], tmp_path: Path,
                                                               where: str) -> None:
    env = staging_env
    write_file_atomic(rank_dir(env) / "trace.jsonl", b'{"a":1}\n')
    elsewhere = tmp_path / "chosen-by-someone-else"
    elsewhere.mkdir()
    link = stream_dir(env) if where == "stream" else stream_dir(env).parent
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere)
    r = opguard(env, "sync", "--rank", "0", "--final")
    assert r.returncode == 6, r.stderr
    assert "symbolic link or not a directory" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sorted(os.listdir(elsewhere)) == [], "the uploader wrote through the planted link"
    assert link.is_symlink()  # left for a person to investigate


def test_a_link_swapped_in_after_the_check_gets_no_batch(staging_env: dict[str, str], tmp_path: Path) -> None:
    """The stream directory is replaced by a link between the directory check and the upload (here:
    before a second sync, whose first act on the target is that check): still refused, nothing there."""
    env = staging_env
    write_file_atomic(rank_dir(env) / "a.bin", b"a")
    assert opguard(env, "sync", "--rank", "0").returncode == 0
    real = stream_dir(env)
    moved = tmp_path / "moved-stream"
    os.rename(real, moved)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real.symlink_to(elsewhere)
    write_file_atomic(rank_dir(env) / "b.bin", b"b")
    r = opguard(env, "sync", "--rank", "0", "--final")
    assert r.returncode == 6, r.stderr
    assert os.listdir(elsewhere) == []


def test_a_link_planted_as_the_seal_is_not_followed(staging_env: dict[str, str], tmp_path: Path) -> None:
    """Between a periodic and the final sync someone plants the final seal's name as a link to a file
    of theirs: the final sync does not read through it (was: it parsed the linked file, and a JSON
    list there was an AttributeError traceback) and refuses (exit 6), the linked file unchanged."""
    env = staging_env
    write_file_atomic(rank_dir(env) / "a.bin", b"a")
    assert opguard(env, "sync", "--rank", "0").returncode == 0
    theirs = tmp_path / "theirs.json"
    theirs.write_bytes(b"[]")
    (stream_dir(env) / "000000000001.seal").symlink_to(theirs)
    r = opguard(env, "sync", "--rank", "0", "--final")
    assert r.returncode == 6, r.stderr
    assert "Traceback" not in r.stderr and "000000000001.seal" in r.stderr, r.stderr
    assert theirs.read_bytes() == b"[]"
