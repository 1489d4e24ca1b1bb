"""Command-line entry points: a thin click layer over the library.

``opguard`` (paths, sync, verify, materialize, ...) and ``opguard-run``. Commands live in
``opguard/cli_*.py`` modules (CLI layer too); library modules never import any of them.
Every :class:`~opguard.errors.OpguardError` becomes one stderr message and its exit status.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from opguard.errors import OpguardError

F = TypeVar("F", bound=Callable[..., Any])


def fail(err: OpguardError) -> None:
    click.echo(f"opguard: error: {err}", err=True)
    sys.exit(err.exit_code)


def handle_errors(fn: F) -> F:
    """Turn OpguardError into a clear stderr message and the error's distinct exit status."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OpguardError as err:
            fail(err)

    return wrapper  # type: ignore[return-value]


# Subcommands live in their own modules and are imported only when invoked (or listed by --help),
# so `opguard sync` and `opguard-run` do not pay for loading compare or restore.
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "sync": ("opguard.cli_staging", "sync_cmd"),
    "materialize": ("opguard.cli_restore", "materialize_cmd"),
    "verify": ("opguard.cli_restore", "verify_cmd"),
    "plan": ("opguard.cli_run", "plan_cmd"),
    "compare": ("opguard.cli_compare", "compare_cmd"),
    "clean": ("opguard.cli_clean", "clean_cmd"),
}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = LAZY_COMMANDS.get(cmd_name)
        if spec is None:
            return super().get_command(ctx, cmd_name)
        import importlib

        cmd = getattr(importlib.import_module(spec[0]), spec[1])
        assert isinstance(cmd, click.Command)
        return cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="opguard")
def main() -> None:
    """opguard: local staging, launcher and comparison tools for distributed training."""


@main.command("paths")
@click.option("--rank", type=int, default=None, help="global rank (default: from the environment)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@handle_errors
def paths_cmd(rank: int | None, as_json: bool) -> None:
    """Print where this process's files, state and bundles live."""
    from opguard.staging.config import StagingConfig
    from opguard.staging.layout import Layout, current_node_id, current_rank

    config = StagingConfig.from_env()
    r = current_rank() if rank is None else rank
    info = Layout(config).as_dict(r, current_node_id(config))
    if as_json:
        click.echo(json.dumps(info, indent=1, sort_keys=True))
    else:
        for k in sorted(info):
            click.echo(f"{k}: {info[k]}")


def run_main() -> None:
    """Entry point of ``opguard-run``."""
    from opguard.cli_run import run_command

    run_command(prog_name="opguard-run")


if __name__ == "__main__":
    main()
