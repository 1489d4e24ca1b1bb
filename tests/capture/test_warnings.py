"""Warnings raised inside torch calls are the program's own (issue 12, ``docs/capture.md`` §11):
under ``opguard-run --capture`` they name the same file and line as without capture, so the message,
``filterwarnings(module=...)`` filters and once-per-location de-duplication behave the same; tracebacks
and ``inspect.stack()`` still work."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")

from tests.capture.helpers import ops, read_trace, trace_dir  # noqa: E402
from tests.capture.test_torchrun import clean_env, run_plain  # noqa: E402
from tests.capture.test_zoo import captured  # noqa: E402

pytestmark = [pytest.mark.torch]
APP = str(Path(__file__).parent / "progs" / "warn_app.py")


@pytest.mark.parametrize("level", ["function", "dispatch"])
def test_warnings_under_capture_name_the_users_line_and_deduplicate_the_same(tmp_path: Path, level: str) -> None:
    plain, cap = tmp_path / "plain", tmp_path / "cap"
    plain.mkdir()
    cap.mkdir()
    run_plain([sys.executable, APP, str(plain)], clean_env())
    base = tmp_path / "traces"
    c = captured([sys.executable, APP, str(cap)], base, level=level)
    assert "Traceback" not in c.stderr
    a = json.loads((plain / "warnings.json").read_text())
    b = json.loads((cap / "warnings.json").read_text())
    # without capture: each warning once per location (two lines of torch.tensor: two), then, with an
    # "always" filter for the script's module, each of the script's warnings three times
    assert [w[2:] for w in a["default"]] == [["warn_app.py", 48], ["warn_app.py", 49], ["warn_app.py", 50],
                                             ["warn_app.py", 36], ["dropout.py", 176]]
    assert len(a["always_main"]) == 3 * 4 + 1
    assert b["default"] == a["default"]
    assert b["always_main"] == a["always_main"]
    assert b["traceback_first"] == a["traceback_first"] and b["traceback_text_ok"] is True
    assert a["hook_stack_has_script"] is True and b["hook_stack_has_script"] is True
    # through re-entered Python-level torch functions too: not capture's handler (mode.py) as before
    nested = next(i for i, t in enumerate(Path(APP).read_text().splitlines(), 1) if "# <nested>" in t)
    # (three times: the "always" filter for __main__ set above applies to the script's own line)
    assert a["nested"] == [["UserWarning", "Full backward hook is firing when gradients are co", "warn_app.py",
                            nested]] * 3
    assert b["nested"] == a["nested"]
    # and the calls were recorded, at the script's lines
    op = ops(read_trace(trace_dir(base)))
    assert {(r["fn"], r["line"]) for r in op} >= {("torch.nn.functional.softmax", 48), ("torch.tensor", 49),
                                                  ("torch.nn.functional.softmax", 36)}


def test_a_stand_in_reads_as_its_callers_frame() -> None:
    """The stand-in of a frame: a C++ warning raised through it names that frame's file, line and
    module, a traceback through it shows that line without carets; no frame: the plain call."""
    import sys
    import traceback
    import warnings

    from opguard.capture import frames

    assert frames.ENABLED and frames.standin(None) is frames.plain
    here = sys._getframe()
    via = frames.standin(here)
    line = here.f_lineno - 1  # the line of the standin() call above
    assert via.__code__.co_firstlineno == line
    x = torch.randn(3)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        via(torch.tensor, (x,), {})
    assert [(w.filename, w.lineno) for w in got] == [(__file__, line)]
    assert via.__globals__ is globals() and via.__code__.co_name == here.f_code.co_name
    try:
        via(torch.cat, ([x, torch.randn(2, 2)],), {})
    except RuntimeError:
        text = traceback.format_exc()
    stand_in_part = text.split(f'File "{__file__}", line {line}')[1].split("File")[0]
    assert "frames.standin(here)" in stand_in_part and "^" not in stand_in_part  # no carets


@pytest.mark.parametrize("hook", ["settrace", "setprofile"])
def test_a_tracer_sees_only_the_program_s_own_calls(tmp_path: Path, hook: str) -> None:
    """A program counting its own functions' calls with ``sys.settrace`` (coverage, a debugger, a
    call counter) or ``sys.setprofile`` (``cProfile``) printed other counts under capture: every
    intercepted call ran through a stand-in whose code carries the program's file and function name,
    and the tracer saw each as a call of the program's function (hand test). While a tracer is set,
    capture calls directly: the tracer sees the program's calls as without capture."""
    import collections

    import opguard.capture as oc

    here = __file__

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) + torch.nn.functional.gelu(x)

    def count() -> collections.Counter[tuple[str, int]]:
        calls: collections.Counter[tuple[str, int]] = collections.Counter()

        def tracer(frame: object, event: str, _arg: object) -> None:
            code = frame.f_code  # type: ignore[attr-defined]
            if code.co_filename == here and event == "call":
                calls[(code.co_name, code.co_firstlineno)] += 1

        getattr(sys, hook)(tracer)
        try:
            f(torch.ones(2))
        finally:
            getattr(sys, hook)(None)
        return calls

    plain = count()
    with oc.capture(env={"OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path)}) as cap:
        got = count()
    assert got == plain and sum(plain.values()) == 1, (got, plain)
    assert {r["fn"] for r in ops(read_trace(cap.path))} >= {"torch.relu", "torch.nn.functional.gelu"}
