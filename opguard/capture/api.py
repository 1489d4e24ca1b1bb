"""The explicit API: ``capture()``, ``context(name)``, ``step(n)``, ``name_modules(module, name)``.

``capture()`` installs, for the calling thread: the torch function mode, global forward hooks for
module paths, the ``torch.distributed`` wrappers and (``level=dispatch``) the aten mode; on exit
it removes them and writes the end of the trace. ``context``/``step`` are no-ops without an
active capture, so instrumented programs run unchanged without it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch.nn.modules import module as nn_module
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from opguard.capture.claim import HeldByThisRun
from opguard.capture.collectives import Collectives, collectives
from opguard.capture.compiles import CompileWindows
from opguard.capture.dispatch import AtenMode, tag_outputs
from opguard.capture.duals import DualLevels
from opguard.capture.fused import FusedModules, candidate, may_take_fast_path
from opguard.capture.futures import FutureCallbacks
from opguard.capture.mode import CaptureMode
from opguard.capture.optim import OptimizerSteps
from opguard.capture.options import CaptureOptions
from opguard.capture.recursion import RecursionHeadroom
from opguard.capture.resize import ResizeGuard
from opguard.capture.sent import SentTensors
from opguard.capture.session import Session
from opguard.capture.swap import SwapGuard
from opguard.capture.tracers import TracerWindows
from opguard.capture.waits import AsyncWaits
from opguard.errors import ConfigError

_root_names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
_active: Capture | None = None


def name_modules(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """Name a root module: its submodules' paths then read ``<name>.layers.3.attn``."""
    if not name or "/" in name:
        raise ConfigError(f"module name {name!r} is empty or contains '/'", "pass a name like 'model'")
    _root_names[module] = name
    return module


_compiling = torch.compiler.is_dynamo_compiling  # False in eager code, True while Dynamo traces


# torch.nn.modules.module's global hook tables (_has_any_global_hook reads these)
_GLOBAL_HOOKS = ("_global_backward_pre_hooks", "_global_backward_hooks", "_global_forward_pre_hooks",
                 "_global_forward_hooks", "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs")
_CALL_IMPL = getattr(getattr(torch.nn.Module, "_call_impl", None), "__code__", None)


def _call_kwargs() -> dict[str, Any]:
    """The keyword arguments of the module call whose global forward pre-hook runs now: the global
    hook gets the positional ones only, and ``nn.TransformerDecoderLayer`` passes its attention's
    ``attn_mask`` by keyword. Read from ``Module._call_impl``'s frame (a few frames up); empty when
    it is not found."""
    f: Any = sys._getframe(2)
    for _ in range(6):
        if f is None:
            break
        if f.f_code is _CALL_IMPL:
            kw = f.f_locals.get("kwargs")
            return kw if isinstance(kw, dict) else {}
        f = f.f_back
    return {}


def _step_wrapper_code() -> Any:
    """The code of the function ``torch.optim`` wraps every ``Optimizer.step`` in (its hooks run
    inside it); ``None`` when this PyTorch has none."""
    try:
        return torch.optim.Optimizer.profile_hook_step(lambda *a, **k: None).__code__
    except Exception:
        return None


_STEP_WRAPPER = _step_wrapper_code()


def _graph_task() -> int:
    """The id of the backward pass (autograd graph task) running on this thread, -1 outside one."""
    try:
        return int(torch._C._current_graph_task_id())
    except Exception:  # a PyTorch without it: every step advances when it returns
        return -1


def _queue_callback(cb: Any) -> None:
    """Run ``cb`` when the backward pass running now finishes (what DDP and FSDP use)."""
    torch.autograd.Variable._execution_engine.queue_callback(cb)


def _inside_another_step() -> bool:
    """Whether the optimizer step whose post-hook runs now was called inside another optimizer's
    step (a wrapper optimizer: ``ZeroRedundancyOptimizer``, Lookahead): two of torch's step
    wrappers on the stack."""
    if _STEP_WRAPPER is None:
        return False
    f: Any = sys._getframe(2)
    seen = 0
    while f is not None:
        if f.f_code is _STEP_WRAPPER:
            seen += 1
            if seen > 1:
                return True
        f = f.f_back
    return False


_DDP = torch.nn.parallel.DistributedDataParallel  # broadcasts buffers in C++ before its module runs


_MAX_HOPS = 512  # frames walked up looking for a running module's hook frame


class ModulePaths:
    """Forward pre-/post-hooks on every module: the path of the innermost running module."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.paths: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        # provisional paths: module -> (a weak reference to the parent it was resolved under, that
        # parent's path then); (None, None) for a root. Weak: the parent holds the module, the key
        self.derived: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, str | None]] = weakref.WeakKeyDictionary()
        self.changes = 0  # paths assigned or changed (optimizer parameter names are rebuilt on a change)
        self.by_class: dict[str, list[weakref.ref[torch.nn.Module]]] = {}  # modules named by their class
        self.running: list[torch.nn.Module] = []
        # the frame that ran each running module's hooks (PyTorch's Module._call_impl): alive while
        # its forward runs, so a module whose forward ended without its post-hook is found (unwind)
        self.frames: list[FrameType] = []
        self.handles: list[Any] = []
        self._has_any: Any = None  # PyTorch's _has_any_global_hook while capture's stands in for it
        # module hooks are global, capture (its function mode) is the starting thread's: another
        # thread's forward must not push onto this thread's module stack
        self.thread = threading.get_ident()
        self.optimizer_steps: OptimizerSteps | None = None  # settled at each forward (optim.py)
        self.fused: FusedModules | None = None  # eval-mode modules kept on PyTorch's fast path (fused.py)

    def path(self, m: torch.nn.Module) -> str:
        """``m``'s path: ``<root>.<name>...`` within the module running around it. A module first
        called outside any forward (a parametrization runs once when ``weight_norm`` builds it) gets
        its class name *provisionally*: it, and every path derived from it, is resolved again when it
        runs under another parent, or its parent's path changed (``derived``). A module called from
        its own forward (``self(x, depth - 1)``) keeps the path it runs under."""
        if any(r is m for r in self.running):
            p = self.paths.get(m)
            if p is not None:
                return p
        return self._path(m, len(self.running) - 1)

    def _path(self, m: torch.nn.Module, i: int) -> str:
        """:meth:`path` of ``m`` running under ``self.running[i]`` (none: ``i`` < 0)."""
        p = self.paths.get(m)
        parent = self.running[i] if i >= 0 else None
        if p is not None:
            how = self.derived.get(m)
            was = how[0]() if how is not None and how[0] is not None else None  # the parent it was resolved under
            if (how is None or (parent is None and how[0] is not None)  # called on its own: keeps its path
                    or (was is parent and (parent is None or self.paths.get(parent) == how[1]))):
                return p
        p = None
        if parent is not None:
            for name, child in parent.named_modules():
                if child is m and name:
                    above = self._path(parent, i - 1)
                    p = f"{above}.{name}"
                    if parent in self.derived:
                        self.derived[m] = (weakref.ref(parent), above)
                    else:
                        self.derived.pop(m, None)
                    break
        if p is None:
            named = _root_names.get(m)
            p = named or self._class_name(m)
            if named is None and parent is None:
                self.derived[m] = (None, None)
            else:
                self.derived.pop(m, None)
        if self.paths.get(m) != p:
            self.paths[m] = p
            self.changes += 1
        return p

    def _class_name(self, m: torch.nn.Module) -> str:
        """A module named by its class (a root, or one its running parent does not hold): the class
        name for the first such module of that class, ``<class>#2``, ``#3``, ... for the next ones
        alive at the same time (a GAN's generator and discriminator, both ``Sequential``); a number
        is reused once its module is gone (a module made per call keeps one name)."""
        base = type(m).__name__
        seen = self.by_class.setdefault(base, [])
        free = None
        for k, ref in enumerate(seen):
            held = ref()
            if held is m:
                return base if k == 0 else f"{base}#{k + 1}"
            if held is None and free is None:
                free = k
        if free is None:
            free = len(seen)
            seen.append(weakref.ref(m))
        else:
            seen[free] = weakref.ref(m)
        return base if free == 0 else f"{base}#{free + 1}"

    def _pre(self, m: torch.nn.Module, args: Any) -> None:
        if _compiling() or threading.get_ident() != self.thread:  # Dynamo: invisible to it; other threads
            return
        caller = sys._getframe(1)
        if self.frames:
            self._unwind(caller)
        if self.session.quiet is not None and self.optimizer_steps is not None:
            self.optimizer_steps.settle()
        fused = self.fused
        if fused is not None and fused.open is not None:
            fused.settle(caller)  # a fused forward left without its post-hook
        try:
            p = self.path(m)
            if fused is not None and fused.open is None and candidate(m):
                kwargs = _call_kwargs()
                if may_take_fast_path(m, args, kwargs):
                    fused.begin(m, p, args, kwargs, caller)
            if self.running and isinstance(self.running[-1], _DDP):
                self._ddp_buffers(self.running[-1], m)
        except Exception as err:
            self.session.failed("recording", err)
            p = type(m).__name__
        self.session.modules.append(p)
        self.running.append(m)
        self.frames.append(caller)

    def _unwind(self, caller: FrameType) -> None:
        """Drop the running modules whose forward is over: PyTorch runs the post-hooks of a forward
        that raised an ``Exception``, not of one left by a ``KeyboardInterrupt`` or ``SystemExit``
        (a Ctrl-C the program catches): every later record kept that module's path. A running
        module's hook frame is a caller of ``caller`` while its forward runs."""
        while self.frames:
            top, f, hops = self.frames[-1], caller.f_back, 0
            while f is not None and f is not top and hops < _MAX_HOPS:
                f, hops = f.f_back, hops + 1
            if f is not None:  # found it (or too deep to tell: never drop a module that may be running)
                return
            self.frames.pop()
            self.running.pop()
            self.session.modules.pop()

    def _post(self, m: torch.nn.Module, _args: Any, out: Any) -> None:
        if _compiling() or threading.get_ident() != self.thread:
            return
        fused = self.fused
        if fused is not None and fused.open is not None and fused.open.module is m:
            # PyTorch runs this hook (always_call) with None from its except clause when the forward raised
            err = sys.exc_info()[1] if out is None else None
            fused.end(m, out, error=None if err is None else f"the forward raised {type(err).__name__}: {err}")
        if self.running and self.running[-1] is m:
            self.running.pop()
            self.frames.pop()
            self.session.modules.pop()

    def _ddp_buffers(self, ddp: Any, m: torch.nn.Module) -> None:
        """``m`` is the module a ``DistributedDataParallel`` forward runs: DDP has just broadcast rank
        0's buffers (BatchNorm running statistics) into it with ``broadcast_buffers=True``, in C++,
        leaving their version counters as they were: their cached contents are dropped, so their
        next use is digested from memory (``docs/capture.md`` §5.3)."""
        if m is getattr(ddp, "module", None) and getattr(ddp, "broadcast_buffers", False):
            self.session.written_unrecorded(list(m.buffers()))

    def install(self) -> None:
        self.thread = threading.get_ident()
        self.handles = [nn_module.register_module_forward_pre_hook(self._pre),
                        nn_module.register_module_forward_hook(self._post, always_call=True)]
        self._has_any = getattr(nn_module, "_has_any_global_hook", None)
        if self._has_any is not None:
            nn_module._has_any_global_hook = self._program_has_global_hook

    def _program_has_global_hook(self) -> Any:
        """``torch.compile(module)`` warns at each call while global module hooks exist (they fire for
        its wrapper too): capture's own do not count, so a captured program warns as its plain run does."""
        has = self._has_any() if self._has_any is not None else False
        if not has:
            return has
        ours = {h.id for h in self.handles}
        return any(k not in ours for name in _GLOBAL_HOOKS for k in getattr(nn_module, name, ()))

    def suspend(self) -> list[tuple[Any, list[tuple[Any, Any]]]]:
        """Take capture's global hooks out of PyTorch's hook dicts (a tracer refusing global hooks,
        ``tracers.py``); :meth:`resume` puts them back at their positions."""
        ours = {h.id for h in self.handles}
        saved = []
        for name in _GLOBAL_HOOKS:
            d = getattr(nn_module, name, None)
            if d is None or not any(k in ours for k in d):
                continue
            saved.append((d, list(d.items())))
            for k in ours:
                d.pop(k, None)
        return saved

    def resume(self, saved: list[tuple[Any, list[tuple[Any, Any]]]]) -> None:
        """Capture's global hooks back where :meth:`suspend` took them from; the program's hooks
        removed meanwhile stay removed, those added meanwhile come after."""
        ours = {h.id for h in self.handles}
        for d, order in saved:
            now = dict(d)
            d.clear()
            for k, v in order:
                if k in ours:
                    d[k] = v
                elif k in now:
                    d[k] = now.pop(k)
            d.update(now)

    def uninstall(self) -> None:
        if getattr(nn_module, "_has_any_global_hook", None) == self._program_has_global_hook:
            nn_module._has_any_global_hook = self._has_any
        self._has_any = None
        for h in self.handles:
            h.remove()
        self.handles = []


class Capture:
    """An active capture in this process (at most one)."""

    def __init__(self, options: CaptureOptions, env: dict[str, str] | None = None) -> None:
        self.options = options
        self.session = Session(options, env)
        c10d = {f"torch.distributed.distributed_c10d.{n}": spec[0] for n, spec in collectives().items()}
        self.mode = CaptureMode(self.session, tag_outputs if options.level == "dispatch" else None, c10d)
        self.aten = AtenMode(self.session) if options.level == "dispatch" else None
        self.modules = ModulePaths(self.session)
        self.collectives = Collectives(self.session)
        self.swaps = SwapGuard(self.session)
        self.sent = SentTensors(self.session)
        self.duals = DualLevels(self.session)
        self.recursion = RecursionHeadroom()
        self.waits = AsyncWaits(self.session)
        self.session.waits = self.waits
        self.resizes = ResizeGuard(self.session)
        self.futures = FutureCallbacks(self.session)
        self.compiles = CompileWindows(self.session)
        self.tracers = TracerWindows(self.session, self.mode, self.modules)
        self.optimizer_steps = (OptimizerSteps(self.session, self.modules, self.mode)
                                if options.optimizer == "step" else None)
        self.modules.optimizer_steps = self.optimizer_steps
        self.modules.fused = FusedModules(self.session, self.mode)
        self._entered: list[Any] = []
        self._optim_hooks: list[Any] = []
        self._thread = threading.get_ident()  # torch function modes are per thread: so are steps (start())
        self._backward_task: int | None = None  # the backward pass whose optimizer steps advance the step at its end

    @property
    def path(self) -> Any:
        return self.session.path

    def start(self) -> Capture:
        global _active
        if _active is not None:
            raise ConfigError("a capture is already active in this process",
                              "start no second Capture (capture() blocks inside a running capture record into it)")
        self._thread = threading.get_ident()
        self.modules.install()
        self.collectives.install()
        self.swaps.install()
        self.sent.install()
        self.duals.install()
        self.recursion.install()
        self.waits.install()
        self.resizes.install()
        self.futures.install()
        self.compiles.install()
        self.tracers.install()
        if self.optimizer_steps is not None:  # each step one record (optim.py): its hooks first
            self._optim_hooks.append(register_optimizer_step_pre_hook(self.optimizer_steps.pre))
            self._optim_hooks.append(register_optimizer_step_post_hook(self.optimizer_steps.post))
            self._optim_hooks.append(self.optimizer_steps.install())
        if self.options.step_auto:
            self._optim_hooks.append(register_optimizer_step_post_hook(self._optimizer_stepped))
        if self.aten is not None:
            self.aten.__enter__()  # type: ignore[no-untyped-call]
            self._entered.append(self.aten)
        self.mode.__enter__()  # type: ignore[no-untyped-call]
        self._entered.append(self.mode)
        _active = self
        return self

    def _optimizer_stepped(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        """Steps without code changes: each ``Optimizer.step()`` advances the step, unless the
        program sets steps itself (``step()``: then markers alone decide). Only the steps of the
        thread that started the capture count (another thread's optimizer is not this capture's)."""
        if _compiling() or threading.get_ident() != self._thread:
            return
        s = self.session
        if s.step_source == "marker" or _inside_another_step():  # the outer step advances it, once
            return
        task = _graph_task()
        if task != -1:  # stepped inside a backward pass (an optimizer per parameter, from its gradient
            # hook): that backward's steps are one training step, advanced once when it finishes
            if task == self._backward_task:
                return
            try:
                _queue_callback(self._backward_done)
                self._backward_task = task
                return
            except Exception:  # no callback to queue: advanced here, as for any other step
                pass
        self._advance()

    def _backward_done(self) -> None:
        """The end of a backward pass in which optimizers stepped (``_optimizer_stepped``)."""
        self._backward_task = None
        if self.session.step_source != "marker" and not self.session.closed:
            self._advance()

    def _advance(self) -> None:
        try:
            self.session.advance("optimizer")
        except Exception as err:  # writing the step record failed: said once, the program goes on
            self.session.failed("writing", err)

    def stop(self) -> None:
        global _active
        if _active is not self:
            return
        _active = None
        try:
            if self.optimizer_steps is not None:
                self.optimizer_steps.before_stop()  # capture's mode back on the stack before it exits
            if self.modules.fused is not None:
                self.modules.fused.stop()
            while self._entered:
                self._entered.pop().__exit__(None, None, None)
        finally:
            self.modules.uninstall()
            self.collectives.uninstall()
            self.swaps.uninstall()
            self.sent.uninstall()
            self.duals.uninstall()
            self.recursion.uninstall()
            self.waits.uninstall()
            self.resizes.uninstall()
            self.futures.uninstall()
            self.compiles.uninstall()
            self.tracers.uninstall()
            while self._optim_hooks:
                self._optim_hooks.pop().remove()
            try:
                self.session.close()
            except Exception as err:  # the end of capture never breaks the program's exit
                print(f"opguard capture: rank {self.session.rank}: writing the end of the trace failed "
                      f"({type(err).__name__}: {err}); meta.json keeps ended_at null", file=sys.stderr, flush=True)


@contextlib.contextmanager
def capture(env: dict[str, str] | None = None, **options: Any) -> Iterator[Capture | None]:
    """Capture every operation in the block; keywords as in ``docs/capture.md`` §1.1 (defaults from env).

    Inside a capture already running in this process (``opguard-run --capture`` captures the whole
    program; or an enclosing block) the block records into that one and yields it: its own options
    are not applied, stderr says so once. In a process that ``opguard-run --capture`` left
    uncaptured (another process of the command holds its rank's capture, or its capture ended), in
    another thread than the capturing one, or in a child forked from a captured process, the block
    runs uncaptured and yields None, saying why once (docs/capture.md §1)."""
    with _starting:  # one start at a time: blocks entered at once by several threads start one capture
        running = _active
        if running is None:
            try:
                cap = Capture(CaptureOptions.from_env(env, **options), env).start()
            except HeldByThisRun as held:  # opguard-run --capture captures another process of this rank
                why = ("this process's capture (opguard-run --capture) has already ended"
                       if str(held.pid) == str(os.getpid()) else
                       f"its rank's capture is held by pid {held.pid} of this same opguard-run --capture command")
                _say_once("held", f"opguard capture: warning: the capture() block of pid {os.getpid()} runs "
                          f"uncaptured: {why} (docs/capture.md §1)")
                cap = None
    if running is not None:
        if getattr(running.session, "pid", None) != os.getpid():
            _say_once("forked", f"opguard capture: warning: the capture() block of pid {os.getpid()} runs uncaptured: "
                      "the process was forked from a captured one, and a forked child records nothing "
                      "(docs/capture.md §11)")
            yield None
        elif threading.get_ident() != running._thread:
            _say_once("thread", "opguard capture: warning: a capture() block in another thread than the one "
                      "capturing this process runs uncaptured: capture records the thread that started it "
                      "(docs/capture.md §11)")
            yield None
        else:
            _say_once("inner", "opguard capture: warning: this process is already captured (opguard-run --capture, "
                      "or an enclosing capture() block): a capture() block inside records into that capture"
                      + (f", without its own options ({', '.join(sorted(options))})" if options or env else "")
                      + " (docs/capture.md §1)")
            yield running
        return
    if cap is None:
        yield None
        return
    try:
        yield cap
    finally:
        cap.stop()


_said: set[str] = set()
_starting = threading.Lock()


def _say_once(kind: str, text: str) -> None:
    if kind not in _said:
        _said.add(kind)
        print(text, file=sys.stderr, flush=True)


def active() -> Capture | None:
    return _active


@contextlib.contextmanager
def context(name: str) -> Iterator[None]:
    """Records made inside carry ``context`` = the enclosing names joined by '/'."""
    if not isinstance(name, str) or not name or "/" in name:
        raise ConfigError(f"capture context name {name!r} is empty, not a string or contains '/'",
                          "pass a short name like 'fwd' (nest contexts for a path)")
    cap = _active
    if cap is None:
        yield
        return
    ctxs = cap.session.contexts
    ctxs.append(name)
    try:
        yield
    finally:
        if ctxs and ctxs[-1] == name:
            ctxs.pop()


def step(n: int | None = None) -> int:
    """Set the current step (``n``) or advance it by one; returns it. Flushes at step boundaries."""
    cap = _active
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise ConfigError(f"step {n!r} is not an integer >= 0", "call step(i) with the training iteration")
    if cap is None:
        return -1 if n is None else n
    s = cap.session
    try:
        s.advance("marker", n)
    except Exception as err:
        s.failed("writing", err)
    return s.step
