"""Launcher tests start real wrappers in the background; whatever a failing test leaves running is
killed at teardown (SIGKILL to the wrapper: PR_SET_PDEATHSIG takes its command with it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.launcher.helpers import LIVE


@pytest.fixture(autouse=True)
def _kill_leftover_wrappers() -> Iterator[None]:
    yield
    while LIVE:
        p = LIVE.pop()
        if p.poll() is None:
            p.kill()
            p.communicate()
