"""Configuration validation: every bad value is named with its variable and a fix, exit status 2."""

from __future__ import annotations

import pytest

from opguard.errors import ConfigError
from opguard.staging.config import MIB, StagingConfig
from tests.helpers.sync import opguard

BASE = {"OPGUARD_TRACE_OUTPUT_BASE": "/shared/run-1", "OPGUARD_LOCAL_DUMP_ENABLED": "1",
        "OPGUARD_LOCAL_DUMP_TARGET": "/shared/run-1", "OPGUARD_LOCAL_DUMP_BASE": "/local/opguard"}

BAD = [
    ("OPGUARD_LOCAL_DUMP_ENABLED", "maybe", "boolean"),
    ("OPGUARD_LOCAL_DUMP_TARGET", "relative/dir", "absolute"),
    ("OPGUARD_LOCAL_DUMP_BASE", "local", "absolute"),
    ("OPGUARD_LOCAL_DUMP_BASE", "/shared/run-1/local", "contain"),
    ("OPGUARD_TRACE_OUTPUT_BASE", "out", "absolute"),
    ("OPGUARD_LOCAL_DUMP_SYNC_INTERVAL", "0", "> 0"),
    ("OPGUARD_LOCAL_DUMP_SYNC_INTERVAL", "soon", "number"),
    ("OPGUARD_SYNC_BATCH_MB", "1.5", "integer"),
    ("OPGUARD_SYNC_BATCH_MB", "0", "> 0"),
    ("OPGUARD_SYNC_MBPS", "-3", "> 0"),
    ("OPGUARD_SYNC_MBPS", "nan", "> 0"),
    ("OPGUARD_SYNC_AGGREGATE_MBPS", "inf", "> 0"),
    ("OPGUARD_SYNC_LOCK_TIMEOUT", "-1", ">= 0"),
    ("OPGUARD_NODE_ID", "localhost", "loopback"),
    ("OPGUARD_NODE_ID", "127.0.0.1", "loopback"),
    ("OPGUARD_NODE_ID", "node 1", "not a valid node ID"),
    ("OPGUARD_NODE_ID", ".hidden", "not a valid node ID"),
    ("OPGUARD_RUN_ID", "a/b", "not a valid run ID"),
    ("OPGUARD_RUN_ID", "", "empty"),
    ("OPGUARD_SYNC_WORKERS", "forks", "not a worker kind"),
]


@pytest.mark.parametrize(("name", "value", "why"), BAD)
def test_bad_value_names_variable_value_and_fix(name: str, value: str, why: str) -> None:
    with pytest.raises(ConfigError) as ei:
        StagingConfig.from_env({**BASE, name: value})
    err = ei.value
    assert name in err.message and why in err.message
    assert value.strip() in err.message or name == "OPGUARD_RUN_ID"
    assert err.fix and err.exit_code == 2


@pytest.mark.parametrize("missing", ["OPGUARD_LOCAL_DUMP_TARGET", "OPGUARD_LOCAL_DUMP_BASE"])
def test_enabled_staging_requires_target_and_base(missing: str) -> None:
    env = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(ConfigError, match=missing) as ei:
        StagingConfig.from_env(env)
    assert ei.value.fix and missing in ei.value.fix


def test_defaults_and_derived_values() -> None:
    c = StagingConfig.from_env(BASE)
    assert (c.sync_interval, c.batch_bytes, c.mbps, c.lock_timeout) == (60.0, 256 * MIB, 32.0, 60.0)
    assert c.run_id == "run-1" and c.rate_bytes_per_s == 32 * MIB
    c = StagingConfig.from_env({**BASE, "OPGUARD_SYNC_BATCH_MB": "8", "OPGUARD_SYNC_MBPS": "0.5",
                                "OPGUARD_LOCAL_DUMP_ENABLED": "yes"})
    assert c.enabled and c.batch_bytes == 8 * MIB and c.rate_bytes_per_s == MIB // 2
    assert c.sync_workers == "auto"
    assert StagingConfig.from_env({**BASE, "OPGUARD_SYNC_WORKERS": " Threads "}).sync_workers == "threads"


def test_run_id_default_from_an_invalid_basename_names_the_source() -> None:
    env = {**BASE, "OPGUARD_LOCAL_DUMP_TARGET": "/shared/run 1", "OPGUARD_TRACE_OUTPUT_BASE": "/shared/run 1"}
    with pytest.raises(ConfigError, match=r"OPGUARD_RUN_ID .*OPGUARD_LOCAL_DUMP_TARGET") as ei:
        StagingConfig.from_env(env)
    assert ei.value.fix


@pytest.mark.parametrize(("name", "value"), [("OPGUARD_SYNC_BATCH_MB", "lots"), ("OPGUARD_NODE_ID", "localhost"),
                                             ("OPGUARD_LOCAL_DUMP_ENABLED", "2")])
def test_cli_exits_2_with_the_message_on_stderr(staging_env: dict[str, str], name: str, value: str) -> None:
    env = {**staging_env, name: value}
    for args in (("sync",), ("paths", "--json")):
        r = opguard(env, *args)
        assert r.returncode == 2, r.stderr
        assert name in r.stderr and repr(value) in r.stderr and "fix:" in r.stderr
        assert r.stdout == ""


def test_sync_without_staging_enabled_is_an_error(staging_env: dict[str, str]) -> None:
    r = opguard({**staging_env, "OPGUARD_LOCAL_DUMP_ENABLED": "0"}, "sync")
    assert r.returncode == 2 and "OPGUARD_LOCAL_DUMP_ENABLED" in r.stderr
