"""``opguard-run [OPTIONS] COMMAND...`` (and ``opguard plan COMMAND...``): the launcher wrapper's CLI.

A thin click layer: preflight and plan come from ``opguard.launcher.preflight``/``plan``, the
supervision from ``opguard.launcher.supervise``. Messages go to stderr; the child's stdout and
stderr are inherited untouched.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from opguard.cli import main
from opguard.errors import ConfigError
from opguard.launcher.mounts import MOUNTINFO

if TYPE_CHECKING:
    from opguard.launcher.preflight import Preflight

DEFAULT_FORWARD = "TERM,INT,HUP,QUIT,USR2"


def parse_signal(name: str, what: str) -> signal.Signals:
    raw = name.strip().upper()
    if raw.isdigit():
        try:
            return signal.Signals(int(raw))
        except ValueError:
            pass
    key = raw if raw.startswith("SIG") else "SIG" + raw
    try:
        return signal.Signals[key]
    except KeyError:
        raise ConfigError(f"{what}: {name!r} is not a signal name", "use names like TERM, USR1, USR2") from None


def parse_signals(spec: str, what: str) -> list[signal.Signals]:
    if spec.strip().lower() in ("", "none"):
        return []
    sigs = [parse_signal(s, what) for s in spec.split(",") if s.strip()]
    bad = [s.name for s in sigs if s in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD)]
    if bad:
        raise ConfigError(f"{what}: {', '.join(bad)} cannot be caught or forwarded", "remove it from the list")
    return sigs


@click.command("opguard-run", context_settings={"help_option_names": ["-h", "--help"],
                                                "ignore_unknown_options": True,
                                                "allow_interspersed_args": False})
@click.option("--plan", "plan_only", is_flag=True,
              help="print the resolved plan and every problem, then exit (0 ok, 2 problems)")
@click.option("--json", "as_json", is_flag=True, help="with --plan: print the plan as JSON on stdout")
@click.option("--quiet", "-q", is_flag=True, help="only errors and the final drain result")
@click.option("--verbose", "-v", is_flag=True, help="more detail (sync commands, signals)")
@click.option("--forward-signals", default=DEFAULT_FORWARD, show_default=True,
              help="signals forwarded to the child's process group ('none' to forward nothing)")
@click.option("--warning-signal", default="USR1", show_default=True,
              help="signal that starts the final drain early ('none' to disable); consumed unless "
              "--forward-warning")
@click.option("--forward-warning", is_flag=True, help="also forward the warning signal to the child")
@click.option("--kill-grace", type=float, default=20.0, show_default=True,
              help="seconds after a forwarded SIGTERM (or the child's exit) before the child's tree is "
              "SIGKILLed")
@click.option("--drain-timeout", type=float, default=None,
              help="give up on the final drain after this many seconds (default: no limit)")
@click.option("--report-json", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="where to write the run report (default: <local base>/state/launcher/<stream>.json)")
@click.option("--no-countdown", is_flag=True, help="do not poll the scheduler for the job's end time")
@click.option("--capture", is_flag=True,
              help="capture per-operation traces in every Python process the command starts (torchrun workers "
              "included; options from OPGUARD_CAPTURE_*, see docs/capture.md)")
@click.option("--resume", is_flag=True,
              help="continue a run whose streams are sealed, as a new attempt (also OPGUARD_RESUME=1; a Slurm "
              "requeue of the same job continues without it); docs/format.md §4.1")
@click.option("--clean-local", is_flag=True,
              help="after the final drain, remove this wrapper's local copies of the streams that are sealed and "
              "re-verified on the target (opguard clean); anything not safely published is kept and listed")
@click.option("--mountinfo", type=click.Path(dir_okay=False, path_type=Path), default=MOUNTINFO, hidden=True,
              help="mount table to read (tests)")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run_command(command: tuple[str, ...], plan_only: bool, as_json: bool, quiet: bool, verbose: bool,
                forward_signals: str, warning_signal: str, forward_warning: bool, kill_grace: float,
                drain_timeout: float | None, report_json: Path | None, no_countdown: bool, capture: bool,
                resume: bool, clean_local: bool, mountinfo: Path) -> None:
    """Run COMMAND under opguard: identity, preflight, periodic syncs, signal forwarding, final drain.

    \b
    Examples:
      srun opguard-run torchrun --nnodes=$SLURM_NNODES --nproc-per-node=4 ... train.py
      mpirun opguard-run python app.py
      opguard-run --plan python app.py
    """
    from opguard.cli import fail
    from opguard.errors import OpguardError

    try:
        code = _run(list(command), plan_only, as_json, quiet, verbose, forward_signals, warning_signal,
                    forward_warning, kill_grace, drain_timeout, report_json, no_countdown, mountinfo, capture,
                    resume, clean_local)
    except OpguardError as err:
        fail(err)
        return
    sys.exit(code)


def _run(cmd: list[str], plan_only: bool, as_json: bool, quiet: bool, verbose: bool, forward_signals: str,
         warning_signal: str, forward_warning: bool, kill_grace: float, drain_timeout: float | None,
         report_json: Path | None, no_countdown: bool, mountinfo: Path, capture: bool = False,
         resume: bool = False, clean_local: bool = False) -> int:
    from opguard.launcher.preflight import run_preflight

    forward = parse_signals(forward_signals, "--forward-signals")
    warn = parse_signals(warning_signal, "--warning-signal")
    if len(warn) > 1:
        raise ConfigError(f"--warning-signal={warning_signal!r} names more than one signal", "name one signal")
    if kill_grace < 0:
        raise ConfigError(f"--kill-grace={kill_grace} is negative", "pass seconds >= 0")
    early: list[int] = []
    if warn and not plan_only:
        # Slurm's --signal may come at any moment, even while the preflight reads shared storage: its
        # default action would kill the wrapper. Record it; the supervisor starts the drain with it.
        signal.signal(warn[0], lambda signum, _frame: early.append(signum))
    capture_env: dict[str, str] | None = None
    if capture:
        try:
            capture_env = _capture_env()
        except ConfigError:
            pass  # bad OPGUARD_CAPTURE_* values: the preflight lists them with every other problem (exit 2)
    pf = run_preflight(cmd, os.environ, mountinfo=mountinfo, resume=resume, capture=capture)
    if plan_only or verbose or not pf.ok:
        from opguard.launcher.plan import build_plan, render  # the derived numbers: only when shown
    if plan_only:
        plan = build_plan(pf, cmd)
        if as_json:
            click.echo(json.dumps(plan, indent=1, sort_keys=True, default=str))
        click.echo(render(plan), err=True)
        return 0 if pf.ok else 2
    if not pf.ok:
        click.echo(render(build_plan(pf, cmd)) if verbose else _problems_text(pf.problems), err=True)
        wrote = _record_node_id_conflicts(pf)
        click.echo("opguard-run: refusing to start the command (exit 2); nothing was written to shared storage"
                   + (" but the conflict marker" if wrote else ""), err=True)
        return 2
    from opguard.launcher.supervise import Options, run

    opts = Options(forward=forward, warning=warn[0] if warn else None, forward_warning=forward_warning,
                   kill_grace=kill_grace, drain_timeout=drain_timeout, report_json=report_json,
                   quiet=quiet, verbose=verbose, countdown=not no_countdown, child_env=capture_env,
                   early_signals=early)
    if verbose:  # the derived numbers walk the staged files: only when asked
        click.echo(render(build_plan(pf, cmd)), err=True)
    attempt = _begin(pf)
    if capture and pf.identity.node_duty:  # one line per node: capture is on, and where it writes
        from opguard.launcher.capturecheck import start_line

        click.echo(start_line(os.environ, pf.config), err=True)
    code = run(cmd, pf, opts)
    if attempt is not None:
        _end(pf, attempt, code, quiet)
    if clean_local:
        _clean_local(pf)
    return code


def _begin(pf: Preflight) -> int | None:
    """Every check passed: create the target's and the local base's last component (docs/format.md
    §1.1) and, on the node's first wrapper, record the attempt (§4.1). Returns its number."""
    from opguard.staging.dirs import LOCAL_BASE_MODE, TARGET_MODE, ensure_dir

    c = pf.config
    if c is None or not c.enabled:
        return None
    assert c.local_base is not None and c.target is not None
    for path, var, mode in ((c.local_base, "OPGUARD_LOCAL_DUMP_BASE", LOCAL_BASE_MODE),
                            (c.target, "OPGUARD_LOCAL_DUMP_TARGET", TARGET_MODE)):
        if ensure_dir(path, var, mode):
            click.echo(f"opguard-run: created {var}={path}", err=True)
    if not pf.identity.node_duty:
        return None
    from opguard.staging.attempts import FIRST, begin_attempt
    from opguard.staging.claim import NodeIdConflict, make_claim, record_conflict
    from opguard.staging.layout import Layout

    # The node ID is claimed before anything is staged: a node that loses the claim race (the
    # preflight saw no claim) must leave no attempt record behind, or the exit hook's sync on it
    # would publish that record under another machine's node ID. The supervisor's own claim then
    # finds this one (same machine) and goes on.
    try:
        make_claim(c, pf.identity.node_id)
    except NodeIdConflict as e:
        _say_recorded_conflict(record_conflict(c.target, e, pf.identity.node_id))
        raise
    number = begin_attempt(Layout(c), pf.identity.node_id, pf.attempt_how or FIRST, os.environ)
    if number > 1:
        click.echo(f"opguard-run: attempt {number} of run {c.run_id} ({pf.attempt_how})", err=True)
    return number


def _end(pf: Preflight, number: int, code: int, quiet: bool) -> None:
    from opguard.errors import OpguardError
    from opguard.staging.attempts import finish_attempt
    from opguard.staging.layout import Layout

    assert pf.config is not None
    try:
        published = finish_attempt(pf.config, Layout(pf.config), pf.identity.node_id, number, code)
    except (OpguardError, OSError) as e:
        click.echo(f"opguard-run: warning: could not record the end of attempt {number}: {e}", err=True)
        return
    if not published and not quiet:
        click.echo(f"opguard-run: the end of attempt {number} is recorded locally (node/attempts.json); the next sync "
                   "of the node stream publishes it", err=True)


def _clean_local(pf: Preflight) -> None:
    """``--clean-local``: ``opguard clean`` of this wrapper's streams, after the final drain."""
    from opguard.cli_clean import render
    from opguard.errors import OpguardError
    from opguard.staging.clean import clean
    from opguard.staging.layout import Layout, node_stream, rank_stream
    from opguard.staging.sync import all_streams

    c = pf.config
    if c is None or not c.enabled:
        click.echo("opguard-run: --clean-local: local staging is off, nothing to clean", err=True)
        return
    layout = Layout(c)
    node_id = pf.identity.node_id
    ranks = pf.identity.owned_ranks()
    if ranks is None:
        streams = all_streams(c, layout, node_id)
    else:
        streams = [rank_stream(r) for r in ranks] + ([node_stream(node_id)] if pf.identity.node_duty else [])
    try:
        report = clean(c, layout, streams, node_id, inside_wrapper=True)
    except OpguardError as e:
        click.echo(f"opguard-run: --clean-local: nothing removed: {e}", err=True)
        return
    for line in render(report):
        click.echo(f"opguard-run: clean: {line}", err=True)


def _capture_env() -> dict[str, str]:
    """The variables ``--capture`` adds to the command's environment (the capture bootstrap on
    PYTHONPATH, OPGUARD_CAPTURE=1, validated OPGUARD_CAPTURE_* options). Imports no torch."""
    from opguard.capture.bootstrap import child_env

    base = dict(os.environ)
    full = child_env(base)
    return {k: v for k, v in full.items() if base.get(k) != v}


def _say_recorded_conflict(path: Path | None) -> None:
    if path is not None:
        click.echo(f"opguard-run: recorded the node ID conflict at {path}: the machine that claimed it "
                   "first stops before it uploads anything", err=True)
    else:
        click.echo("opguard-run: could not record the node ID conflict on the target: the machine that "
                   "claimed it first may keep running; stop the job", err=True)


def _record_node_id_conflicts(pf: Preflight) -> bool:
    """A node ID claimed by another machine: leave a conflict marker beside the claim, so the machine
    that claimed it first stops too (``docs/format.md`` §5.3). True if one was written."""
    from opguard.launcher.claim import NodeIdConflict, record_conflict

    target = pf.config.target if pf.config is not None else None
    for p in pf.problems:
        if isinstance(p, NodeIdConflict) and target is not None:
            path = record_conflict(target, p, pf.identity.node_id)
            _say_recorded_conflict(path)
            return path is not None
    return False


def _problems_text(problems: list[ConfigError]) -> str:
    lines = [f"opguard-run: {len(problems)} problem(s) before start:"]
    for p in problems:
        lines.append(f"  - {p.message}")
        if p.fix:
            lines.append(f"      fix: {p.fix}")
    return "\n".join(lines)


@main.command("plan", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON on stdout")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def plan_cmd(command: tuple[str, ...], as_json: bool) -> None:
    """Same as ``opguard-run --plan COMMAND...``: print the plan, exit 0 or 2 listing every problem."""
    args = ["--plan", *(["--json"] if as_json else []), *command]
    run_command.main(args=args, prog_name="opguard plan")
