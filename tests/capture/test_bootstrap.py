"""The launcher-facing side: options, child_env (pure, no torch), agent detection, the
sitecustomize chain. These tests need no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opguard.capture.bootstrap import SITE_DIR, child_env, is_agent
from opguard.capture.options import CaptureOptions, StepSet
from opguard.errors import ConfigError
from tests.conftest import REPO


def test_child_env_is_pure_and_complete() -> None:
    env = {"PATH": "/bin", "PYTHONPATH": "/user/lib", "OPGUARD_TRACE_OUTPUT_BASE": "/x"}
    out = child_env(env, CaptureOptions(digest="xor", steps=StepSet.parse("2-4", "steps"), max_mb=5))
    assert env == {"PATH": "/bin", "PYTHONPATH": "/user/lib", "OPGUARD_TRACE_OUTPUT_BASE": "/x"}
    assert out["OPGUARD_CAPTURE"] == "1"
    assert out["PYTHONPATH"].split(os.pathsep)[:2] == [str(SITE_DIR), "/user/lib"]
    assert CaptureOptions.from_env(out) == CaptureOptions(digest="xor", steps=StepSet(((2, 4),)), max_mb=5)
    again = child_env(out)
    assert again["PYTHONPATH"].split(os.pathsep).count(str(SITE_DIR)) == 1


def test_importing_the_bootstrap_does_not_import_torch() -> None:
    code = ("import opguard.capture, opguard.capture.bootstrap, opguard.capture.options, sys; "
            "print(any(m.split('.')[0] in ('torch', 'numpy') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("env", "match"), [
    ({"OPGUARD_CAPTURE_DIGEST": "md5"}, "OPGUARD_CAPTURE_DIGEST"),
    ({"OPGUARD_CAPTURE_LEVEL": "aten"}, "OPGUARD_CAPTURE_LEVEL"),
    ({"OPGUARD_CAPTURE_STEPS": "3-1"}, "OPGUARD_CAPTURE_STEPS='3-1'"),
    ({"OPGUARD_CAPTURE_STEPS": "x"}, "OPGUARD_CAPTURE_STEPS='x'"),
    ({"OPGUARD_CAPTURE_MAX_MB": "0"}, "OPGUARD_CAPTURE_MAX_MB"),
    ({"OPGUARD_CAPTURE_MAX_MB": "lots"}, "OPGUARD_CAPTURE_MAX_MB='lots'"),
    ({"OPGUARD_CAPTURE_BUFFER": "0"}, "OPGUARD_CAPTURE_BUFFER"),
    ({"OPGUARD_CAPTURE_DUMP_SITES": "train.py"}, "FILE:LINE"),
    ({"OPGUARD_CAPTURE_NESTED": "maybe"}, "OPGUARD_CAPTURE_NESTED='maybe'"),
])
def test_bad_options_name_the_variable_and_the_fix(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        child_env(env)
    assert info.value.fix


def test_steps_parsing() -> None:
    s = StepSet.parse("0-2, 7", "steps")
    assert [i for i in range(10) if i in s] == [0, 1, 2, 7]
    assert 10**9 in StepSet.parse("all", "steps") and 0 not in StepSet.parse("none", "steps")
    assert str(s) == "0-2,7"


@pytest.mark.parametrize(("orig", "argv", "agent"), [
    (["python", "-m", "torch.distributed.run", "--nproc-per-node=2", "a.py"], ["-m"], True),
    (["python", "-mtorch.distributed.launch", "a.py"], ["-m"], True),
    (["/venv/bin/python", "/venv/bin/torchrun", "a.py"], ["/venv/bin/torchrun", "a.py"], True),
    (["python", "-u", "train.py"], ["train.py"], False),
    (["python", "-m", "mypkg.train"], ["-m"], False),
    (["python", "-c", "import torch"], ["-c"], False),
    (["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
      "--multiprocessing-fork"], ["-c", "--multiprocessing-fork"], True),
    (["python", "-m", "torch._inductor.compile_worker", "--workers=2"], ["-m"], True),
])
def test_agent_detection(orig: list[str], argv: list[str], agent: bool) -> None:
    assert is_agent(orig, argv) is agent


def test_sitecustomize_chains_to_an_existing_one_and_stays_off_without_the_flag(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPGUARD_")}
    env = child_env({**env, "PYTHONPATH": str(other), "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "t")})
    code = "import os, sys; print(os.environ.get('CHAINED'), 'opguard.capture.bootstrap' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["yes", "True"]
    env["OPGUARD_CAPTURE"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["yes", "False"]
    assert not (tmp_path / "t").exists()                     # no torch imported: nothing captured


def test_bad_option_fails_at_interpreter_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPGUARD_")}
    env = child_env({**env, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "t")})
    env["OPGUARD_CAPTURE_DIGEST"] = "crc"
    r = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "ran" not in r.stdout and "OPGUARD_CAPTURE_DIGEST" in r.stderr


def test_unusable_staging_refuses_the_program(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPGUARD_")}
    env = child_env({**env, "OPGUARD_LOCAL_DUMP_ENABLED": "1", "OPGUARD_LOCAL_DUMP_TARGET": str(tmp_path / "shared"),
                     "OPGUARD_LOCAL_DUMP_BASE": str(tmp_path / "no-such-dir" / "base")})
    r = subprocess.run([sys.executable, "-c", "import torch; print('ran')"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "ran" not in r.stdout
    assert "OPGUARD_LOCAL_DUMP_BASE" in r.stderr and "refusing" in r.stderr
    assert not (tmp_path / "shared").exists()


def test_the_program_s_sys_path_gains_only_the_bootstrap_directory(tmp_path: Path) -> None:
    """``child_env`` also put the directory holding the opguard package on ``PYTHONPATH``: in a
    source checkout that made its ``tests`` package (and ``setup.py``) importable by the program,
    ahead of site-packages, and PyTorch's log lines named files relative to it (hand tests:
    ``import tests`` succeeded only under capture; torchrun's banner changed). The bootstrap now
    imports opguard from its own location without leaving that directory on ``sys.path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPGUARD_") and k != "PYTHONPATH"}
    code = ("import json, sys; print(json.dumps([sys.path, 'opguard.capture.bootstrap' in sys.modules, "
            "__import__('importlib').util.find_spec('tests') is not None]))")
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                           cwd=tmp_path)
    cap_env = child_env({**env, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "t")})
    assert cap_env["PYTHONPATH"] == str(SITE_DIR)
    cap = subprocess.run([sys.executable, "-c", code], env=cap_env, capture_output=True, text=True, check=True,
                         cwd=tmp_path)
    (path_a, boot_a, tests_a), (path_b, boot_b, tests_b) = json.loads(plain.stdout), json.loads(cap.stdout)
    assert [p for p in path_b if p != str(SITE_DIR)] == path_a
    assert (boot_a, boot_b) == (False, True)
    assert tests_b == tests_a


@pytest.mark.parametrize("first", [False, True])
def test_a_python_subprocess_of_the_program_is_not_a_rank_of_its_own(tmp_path: Path, first: bool) -> None:
    """A Python the program starts itself (``subprocess.run([sys.executable, ...])``) inherits the
    bootstrap and resolved to the same rank: it was refused (exit 2, "already holds a capture"),
    and one started *before* the program imported torch took the rank's directory, so the program
    itself was refused. Now a Python started after capture began in its parent is not a rank
    (``OPGUARD_CAPTURE_OWNER``), and one that finds the rank's capture held by another process of
    this same command (``OPGUARD_CAPTURE_RUN``) runs uncaptured and says so on stderr: the first
    Python of a rank that imports torch is captured, and no process is refused."""
    pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPGUARD_")}
    env = child_env({**env, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "t")})
    child = ("import subprocess, sys; r = subprocess.run([sys.executable, '-c', "
             "'import torch; print(torch.arange(4.0).sum().item())']); print('child rc', r.returncode)")
    code = f"{child}\nimport torch\ntorch.ones(2).sum()\n" if first else f"import torch\ntorch.ones(2).sum()\n{child}\n"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["6.0", "child", "rc", "0"] and "refusing" not in r.stderr, r
    trace = (tmp_path / "t" / "ranks" / "rank-000000" / "capture" / "trace.jsonl").read_text()
    fns = {json.loads(line).get("fn") for line in trace.splitlines()}
    if first:   # the child imported torch first: it is the rank's capture, the program says it is not
        assert "torch.arange" in fns and "torch.ones" not in fns
        assert r.stderr.count("is not captured: its rank's capture is held by pid") == 1, r.stderr
    else:       # the program's calls, not the child's; nothing said in the child
        assert "torch.ones" in fns and "torch.arange" not in fns and "not captured" not in r.stderr


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_program_that_re_executes_itself_is_never_refused(tmp_path: Path, when: str) -> None:
    """``os.execv`` keeps the pid and the environment. Before ``import torch`` the new image is the
    rank's process and captures; after it, the rank's capture is the old image's, and the new
    image runs uncaptured and says so (it was refused: exit 2, its output lost)."""
    pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPGUARD_")}
    env = child_env({**env, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "e")})
    exec_line = "if len(sys.argv) < 2: os.execv(sys.executable, [sys.executable, '-c', sys.orig_argv[-1], 'again'])"
    code = (f"import os, sys\n{exec_line}\nimport torch\ntorch.zeros(3).sum()\nprint('ran', len(sys.argv))\n"
            if when == "before" else
            f"import os, sys\nimport torch\ntorch.ones(3).sum()\n{exec_line}\nprint('ran', len(sys.argv))\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ["ran", "2"], r
    trace = (tmp_path / "e" / "ranks" / "rank-000000" / "capture" / "trace.jsonl").read_text()
    assert ("torch.zeros" if when == "before" else "torch.ones") in trace
    assert ("not captured" in r.stderr) == (when == "after"), r.stderr


def test_a_forked_child_that_execs_leaves_the_parent_s_capture_alone(tmp_path: Path) -> None:
    """``os.execv`` ends the capture first, but only in the capturing process: a child forked from it
    (records nothing) that execs must not stop or rewrite the parent's trace."""
    pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPGUARD_")}
    env = child_env({**env, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "f")})
    code = ("import os, sys\nimport torch\ntorch.ones(2).sum()\npid = os.fork()\n"
            "if pid == 0: os.execv(sys.executable, [sys.executable, '-c', 'print(\"child\")'])\n"
            "os.waitpid(pid, 0)\ntorch.zeros(2).sum()\nprint('parent')\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and sorted(r.stdout.split()) == ["child", "parent"], r
    cap = tmp_path / "f" / "ranks" / "rank-000000" / "capture"
    assert "torch.zeros" in (cap / "trace.jsonl").read_text()      # the parent went on capturing
    meta = json.loads((cap / "meta.json").read_text())
    assert meta["ended_at"] is not None and not any("replaced itself" in n for n in meta["notes"]), meta["notes"]


def test_scripts_run_one_after_another_by_a_shell_are_never_refused(tmp_path: Path) -> None:
    """``opguard-run --capture bash run.sh`` running two Python scripts: the second was refused
    (exit 2), changing the script's exit status; a Python launcher that never imports torch left
    its child uncaptured. The first Python of the rank that imports torch is captured."""
    pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPGUARD_")}
    env = child_env({**env, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "s")})
    (tmp_path / "s1.py").write_text("import torch\ntorch.ones(2).sum()\nprint('s1')\n")
    (tmp_path / "s2.py").write_text("import torch\ntorch.zeros(2).sum()\nprint('s2')\n")
    r = subprocess.run(["bash", "-c", f"{sys.executable} s1.py && {sys.executable} s2.py"], env=env,
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ["s1", "s2"], r
    assert "torch.ones" in (tmp_path / "s" / "ranks" / "rank-000000" / "capture" / "trace.jsonl").read_text()
    assert r.stderr.count("is not captured") == 1
    # a launcher that never imports torch: its child is the rank's process
    launcher = "import subprocess, sys; subprocess.run([sys.executable, 's1.py'], check=True)"
    r = subprocess.run([sys.executable, "-c", launcher], env={**env, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "l")},
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "not captured" not in r.stderr, r
    assert "torch.ones" in (tmp_path / "l" / "ranks" / "rank-000000" / "capture" / "trace.jsonl").read_text()


def test_a_program_that_ends_with_an_uncaught_exception_says_so_in_the_meta(tmp_path: Path) -> None:
    """Compare named the first call only one run made, never that run B crashed there: the rank's
    meta notes now say which exception ended the program (compare prints meta notes)."""
    pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPGUARD_")}
    env = child_env({**env, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "t")})
    code = "import torch\nx = torch.ones(2).sum()\nraise ValueError('boom  at\\nstep 3')\n"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.rstrip().endswith("ValueError: boom  at\nstep 3"), r.stderr
    meta = json.loads((tmp_path / "t" / "ranks" / "rank-000000" / "capture" / "meta.json").read_text())
    assert "the program ended with an uncaught exception after record seq 1: ValueError: boom at step 3" in \
        meta["notes"], meta["notes"]
    ok = subprocess.run([sys.executable, "-c", "import torch\ntorch.ones(2)\n"], env={
        **env, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "u")}, capture_output=True, text=True, check=True)
    meta = json.loads((tmp_path / "u" / "ranks" / "rank-000000" / "capture" / "meta.json").read_text())
    assert ok.returncode == 0 and not any("uncaught" in n for n in meta["notes"])


def test_the_explicit_api_inside_opguard_run_capture_records_into_the_running_capture(tmp_path: Path) -> None:
    """A program written for the explicit API (``with oc.capture():``) run under ``opguard-run
    --capture``: the block started a second capture in the process already captured, which failed
    with a traceback ("held by pid N of this same command", N its own pid) and exit 1. The block now
    records into the running capture and says so once; a ``capture()`` block in a process the
    wrapper left uncaptured (another process holds the rank) runs uncaptured, saying why."""
    pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPGUARD_")}
    env = child_env({**env, "OPGUARD_TRACE_OUTPUT_BASE": str(tmp_path / "t")})
    code = ("import torch, subprocess, sys\nimport opguard.capture as oc\n"
            "for _ in range(2):\n    with oc.capture(steps='0') as cap:\n        x = torch.ones(3) * 2\n"
            "    print(cap is __import__('opguard.capture.api').capture.api.active(), x.sum().item())\n"
            "inner = ('import torch, opguard.capture as oc\\n'\n"
            "         'with oc.capture() as c:\\n    print(c, torch.ones(2).sum().item())')\n"
            "env = dict(__import__('os').environ); env.pop('OPGUARD_CAPTURE_OWNER')\n"
            "print(subprocess.run([sys.executable, '-c', inner], env=env).returncode)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:4] == ["True 6.0", "True 6.0", "None 2.0", "0"], r
    assert r.stderr.count("this process is already captured") == 1 and "without its own options (steps)" in r.stderr
    assert r.stderr.count("runs uncaptured: its rank's capture is held by pid") == 1, r.stderr
    assert "Traceback" not in r.stderr
    trace = (tmp_path / "t" / "ranks" / "rank-000000" / "capture" / "trace.jsonl").read_text()
    fns = [json.loads(line).get("fn") for line in trace.splitlines()]
    assert fns.count("Tensor.mul") == 2 and "torch.ones" in fns


def test_a_second_capture_block_of_one_process_says_what_happened(tmp_path: Path) -> None:
    """Two ``with oc.capture():`` blocks one after the other in a plain Python: the second was
    refused as "traces of two runs, or of two processes that both resolved to rank 0", neither of
    which had happened. It now says this process captured there in an earlier block, and the fix."""
    pytest.importorskip("torch", reason="capture needs torch (pip install torch, CPU build)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPGUARD_")}
    env["OPGUARD_TRACE_OUTPUT_BASE"] = str(tmp_path / "t")
    code = ("import torch\nimport opguard.capture as oc\nfrom opguard.errors import ConfigError\n"
            "with oc.capture():\n    torch.ones(2)\n"
            "try:\n    with oc.capture():\n        torch.ones(2)\nexcept ConfigError as e:\n    print(e, '|', e.fix)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path,
                       check=True)
    assert "in an earlier capture() block; a rank's directory holds one capture" in r.stdout, r
    assert "keep one capture() block open over every part to capture" in r.stdout, r
