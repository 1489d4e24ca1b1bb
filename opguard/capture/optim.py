"""An optimizer step as one record (``optimizer=step``, the default; ``docs/capture.md`` §3.8).

PyTorch's optimizers update each parameter with a handful of small ops (AdamW on CPU: about eight
per parameter). Recorded one by one they are most of a small model's records and most of capture's
cost, while what explains a divergence there is which parameter or state came out different, and
with which settings. So each ``Optimizer.step()`` is one record with ``api: "optimizer"``:

* ``fn``: ``torch.optim.<Class>.step`` for PyTorch's optimizers, ``<module>.<qualname>.step`` for
  others; the call site is the program's ``step()`` line;
* ``args``: every param-group setting but ``params`` (``group<g>.<key>``: ``lr``, ``betas``, ...);
  a tensor-valued setting is an input entry of that slot;
* ``inputs`` (taken at the global step pre-hook, before the optimizer's own pre-hooks): for every
  parameter with a gradient, in param-group order, the parameter (slot = its module path, e.g.
  ``GPT.h.0.attn.c_attn.weight``, or ``group<g>.params.<i>`` when no module that ran holds it), its
  gradient (``<slot>.grad``) and its optimizer state (``<slot>.<key>``: ``exp_avg``, ``step``, ...;
  non-tensor state values are ``args``);
* ``outputs`` (taken when the step returns, before the optimizer's own post-hooks: PyTorch's step
  wrapper calls ``Optimizer._optimizer_step_code`` there, which capture wraps; the global post-hook
  for a class that overrides it): the same parameters and their state after the step, with
  statistics. The optimizer's own post-hooks (``register_step_post_hook``: an EMA update) are then
  the program's calls, recorded as such; its own pre-hooks run inside the record, unrecorded.

The calls inside the step run without being recorded (``Session.quiet``; collectives inside are
still recorded, as its children). When capture's function mode is the innermost torch function
mode, it is taken off the mode stack for the step (the step's calls then cost nothing extra) and put
back at the post-hook; otherwise the modes let the calls through. A step that raises is recorded
with ``error`` and the outputs as the step left them. With the mode on the stack, the close of the
``record_function`` range PyTorch opens around every step, seen while the step is still open, says
so at once; with the mode off the stack, the next module forward, optimizer step or the end of the
capture finds the step's frame gone from the stack, puts the mode back and closes the record (the
calls in between are not recorded; the record's ``error`` says so). A step called with a closure
(``LBFGS``; the closure runs the model) is recorded op by op, and ``optimizer=ops`` records every
step op by op.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterator, Mapping
from types import FrameType
from typing import Any

import torch

from opguard.capture import modestack, records
from opguard.capture.session import Call, Session

_compiling = torch.compiler.is_dynamo_compiling
_no_modes = torch._C.DisableTorchFunction  # capture's own tensor reads skip the modes (and their cost)
_profiler = torch.ops.profiler
# the ops of torch.autograd.profiler.record_function (PyTorch wraps every Optimizer.step() in one)
RANGE_ENTER = frozenset({_profiler._record_function_enter_new, _profiler._record_function_enter})
RANGE_EXIT = frozenset({_profiler._record_function_exit, _profiler._record_function_exit._RecordFunction})


def step_name(opt: Any) -> str:
    cls = type(opt)
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}.step"
    return f"{cls.__module__}.{cls.__qualname__}.step"


class OpenStep:
    """One ``Optimizer.step()`` being recorded (``Session.quiet`` while it runs)."""

    def __init__(self, steps: OptimizerSteps, opt: Any) -> None:
        self.steps = steps
        self.opt = opt
        self.call: Call | None = None
        self.params: list[tuple[str, torch.Tensor]] = []
        self.ranges = 0  # record_function ranges opened inside the step and not closed yet
        self.frame: FrameType | None = None  # PyTorch's step wrapper, running the step
        self.popped: modestack.Taken | None = None  # capture's function mode, while off the stack for the step

    def profiler_op(self, func: Any) -> None:
        """A profiler op seen while the step runs: the close of the step's own range before the
        post-hook ran means the step raised."""
        if func in RANGE_ENTER:
            self.ranges += 1
        elif func in RANGE_EXIT:
            if self.ranges:
                self.ranges -= 1
            else:
                exc = sys.exc_info()[1]
                what = f"{type(exc).__name__}: {exc}" if exc is not None else "the step did not return"
                self.steps.end(self, error=what)

    def abandon(self) -> None:
        """The capture ended while the step is open (it never returned): the record is closed;
        capture's mode was put back for its exit (``OptimizerSteps.before_stop``), never again."""
        self.popped = None
        self.steps.end(self, error="the step did not return before the capture ended")


class OptimizerSteps:
    """The global step pre-/post-hooks of ``optimizer=step``."""

    def __init__(self, session: Session, modules: Any, mode: Any = None) -> None:
        self.session = session
        self.modules = modules  # api.ModulePaths: .paths (module -> path), .changes (bumped on every change)
        self.mode = mode  # capture's function mode: off the stack during a step when it is the innermost
        # capture records the thread that started it (torch function modes are per thread): a step
        # run by another thread is not this capture's, and must not silence this thread's calls
        self.thread = threading.get_ident()
        # per optimizer: id(parameter) -> module path, and how many modules it was built from
        self._names: weakref.WeakKeyDictionary[Any, tuple[int, dict[int, str]]] = weakref.WeakKeyDictionary()
        self.code: _StepCode | None = None  # the wrapped Optimizer._optimizer_step_code (install())
        self._firsts: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # capture's first post-hook
        self.handles: list[Any] = []  # their handles: removed when capture stops

    # ---- hooks --------------------------------------------------------------------------------
    def pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        if _compiling() or threading.get_ident() != self.thread:
            return
        s = self.session
        if s.quiet is not None:
            self.settle()
        if s.quiet is not None or s.busy:  # an optimizer stepped by another one's step: inside its record
            return
        if (len(args) > 1 and args[1] is not None) or (kwargs or {}).get("closure") is not None:
            if s.active:  # the closure runs the model: recorded op by op, after a record of the settings
                s.busy += 1
                try:
                    with _no_modes():
                        self._settings(opt, sys._getframe(1))
                except Exception as err:
                    s.failed("recording", err)
                finally:
                    s.busy -= 1
            return
        step = OpenStep(self, opt)
        s.quiet = step
        if self.code is not None and getattr(type(opt), "_optimizer_step_code", None) is not self.code.wrapper:
            self._first_post_hook(opt)  # a class of its own there: the record ends at a post-hook of its own
        caller = sys._getframe(1)
        step.frame = caller
        if self.mode is not None:
            step.popped = modestack.take_off(self.mode)
        if not s.active:
            return
        s.busy += 1
        try:
            with _no_modes():
                self._begin(step, caller)
        except Exception as err:
            s.failed("recording", err, step.call)
        finally:
            s.busy -= 1

    def _record(self, opt: Any, caller: FrameType) -> Call | None:
        """A new ``api: "optimizer"`` record of ``opt``'s step called from ``caller``; None when a
        filter leaves it out."""
        s = self.session
        name = step_name(opt)
        modules, contexts = s.modules, s.contexts
        module = modules[-1] if modules else None
        context = "/".join(contexts) if contexts else None
        if not (s.select_all or s.selected(name, module, context)):
            return None
        return s.begin("optimizer", name, s.sites.lookup(caller), where=(module, context))

    def _begin(self, step: OpenStep, caller: FrameType) -> None:
        s, opt = self.session, step.opt
        step.call = call = self._record(opt, caller)
        if call is None:
            return
        ins: list[tuple[str, torch.Tensor]] = []
        xs: list[dict[str, Any]] = []
        for slot, value in self._before(opt, step):
            if isinstance(value, torch.Tensor):
                ins.append((slot, value))
            else:
                xs.append(records.arg_entry(slot, value))
        if xs:
            call.rec["args"] = xs
        s.inputs(call, ins)
        s.parents.append(call.rec["seq"])

    def _settings(self, opt: Any, caller: FrameType) -> None:
        """The record of a step given a closure: its settings (``args``, as a step record's), marked
        ``closure: true``, without tensors; the step's calls follow it, recorded one by one."""
        call = self._record(opt, caller)
        if call is None:
            return
        call.rec["closure"] = True
        xs = [records.arg_entry(f"group{g}.{k}", v) for g, group in enumerate(opt.param_groups)
              for k, v in group.items() if k != "params"]
        if xs:
            call.rec["args"] = xs
        self.session.maybe_flush_contained()

    def post(self, opt: Any, _args: Any, _kwargs: Any) -> None:
        if _compiling() or threading.get_ident() != self.thread:
            return
        step = self.session.quiet
        if isinstance(step, OpenStep) and step.opt is opt:
            self.end(step)

    def install(self) -> _StepCode:
        """Wrap ``Optimizer._optimizer_step_code``, which PyTorch's step wrapper calls when the step
        returned, before the optimizer's own post-hooks: the record ends there. For a class that
        overrides it, a post-hook of capture's own, put first among the optimizer's post-hooks, ends
        it (:meth:`_first_post_hook`). The returned handle's ``remove()`` restores both."""
        self.code = _StepCode(self)
        return self.code

    def _first_post_hook(self, opt: Any) -> None:
        """Put capture's post-hook (:meth:`post`) first among ``opt``'s own post-hooks (once per
        optimizer; moved to the front again when the program registered one since)."""
        try:
            hooks = opt._optimizer_step_post_hooks
            key = self._firsts.get(opt)
            if key is None or key not in hooks:
                handle = opt.register_step_post_hook(self.post)
                self.handles.append(handle)
                key = handle.id
                self._firsts[opt] = key
            hooks.move_to_end(key, last=False)
        except Exception as err:  # capture's own failure: the global post-hook ends the record instead
            self.session.failed("recording", err)

    def settle(self) -> None:
        """Close the open step if it is no longer running (it raised while the mode was off the stack)."""
        step = self.session.quiet
        if not isinstance(step, OpenStep) or step.frame is None:
            return
        f: FrameType | None = sys._getframe(1)
        while f is not None:
            if f is step.frame:
                return
            f = f.f_back
        self.end(step, error="the step raised (it did not return); the calls from then to the next module "
                             "forward, optimizer step or the end of the capture were not recorded")

    def before_stop(self) -> None:
        """The capture is stopping: a step that raised is closed; for one still open (the capture
        stopped inside it) capture's mode goes back on the stack, so that its exit pops itself."""
        self.settle()
        step = self.session.quiet
        if isinstance(step, OpenStep) and step.popped is not None:
            modestack.put_back(step.popped)
            step.popped = None

    def end(self, step: OpenStep, error: str | None = None) -> None:
        """Close ``step``: its outputs (the parameters and state now), ``error`` when it raised."""
        s = self.session
        if s.quiet is step:
            s.quiet = None
        step.frame = None
        if step.popped is not None:
            modestack.put_back(step.popped)
            step.popped = None
        call = step.call
        if call is None:  # not recorded (a filter left it out): what it wrote is still seen (§5.3)
            try:
                s.written_unrecorded([*(p for g in step.opt.param_groups for p in g["params"]),
                                      *(v for st in _State(step.opt).values() if isinstance(st, dict)
                                        for v in st.values())])
            except Exception as err:
                s.failed("recording", err)
            return
        step.call = None
        s.busy += 1
        try:
            with _no_modes():
                if error is not None:
                    call.rec["error"] = error[:500]
                if s.parents and s.parents[-1] == call.rec["seq"]:
                    s.parents.pop()
                if not s.cap_reached:
                    # fresh: a step may write through .data (p.data.add_(...)), which leaves
                    # p._version as it was; the digests are taken from memory, never the cache
                    s.outputs(call, self._after(step), fresh=True)
                # and the gradients it read: an old-style step writes them through .data too (d_p =
                # p.grad.data; d_p.add_(p.data, alpha=wd)): their next use is digested from memory;
                # so are its parameters without a gradient (not in the record; a decay through .data)
                s.written_unrecorded([p.grad for _, p in step.params if p.grad is not None])
                updated = {id(p) for _, p in step.params}
                s.written_unrecorded([p for g in step.opt.param_groups for p in g["params"] if id(p) not in updated])
        except Exception as err:
            s.failed("recording", err, call)
        finally:
            s.busy -= 1
        s.maybe_flush_contained()

    # ---- what a step reads and writes ----------------------------------------------------------
    def _before(self, opt: Any, step: OpenStep) -> Iterator[tuple[str, Any]]:
        """(slot, value) of every setting, parameter, gradient and state value the step reads."""
        names = self._param_names(opt)
        state = _State(opt)
        used: dict[str, int] = {}
        for g, group in enumerate(opt.param_groups):
            for k, v in group.items():
                if k != "params":
                    yield f"group{g}.{k}", v
            for i, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:  # not updated by this step
                    continue
                slot = names.get(id(p)) or f"group{g}.params.{i}"
                if slot in used:  # two root modules of one class (Linear.weight twice): made unique
                    used[slot] += 1
                    slot = f"{slot}#{used[slot]}"
                used[slot] = 1
                step.params.append((slot, p))
                yield slot, p
                yield f"{slot}.grad", grad
                for k, v in _items(state.get(p)):
                    yield f"{slot}.{k}", v

    @staticmethod
    def _after(step: OpenStep) -> list[tuple[str, torch.Tensor]]:
        """(slot, tensor) of every parameter the step updated and its state tensors, now."""
        state = _State(step.opt)
        outs: list[tuple[str, torch.Tensor]] = []
        for slot, p in step.params:
            outs.append((slot, p))
            outs.extend((f"{slot}.{k}", v) for k, v in _items(state.get(p)) if isinstance(v, torch.Tensor))
        return outs

    def _param_names(self, opt: Any) -> dict[int, str]:
        """id(parameter) -> ``<module path>.<name>`` over the modules that ran a forward, then their
        submodules that did not (``MultiheadAttention.out_proj``, whose weight the attention reads
        directly) (rebuilt when a module path was added or changed since; a tied parameter keeps the
        first path)."""
        modules = self.modules
        known = self._names.get(opt)
        if known is not None and known[0] == modules.changes:
            return known[1]
        names: dict[int, str] = {}
        ran = list(modules.paths.items())
        for m, path in ran:
            for n, p in m.named_parameters(recurse=False):
                names.setdefault(id(p), f"{path}.{n}")
        for m, path in ran:  # parameters of submodules whose forward never runs (MultiheadAttention.out_proj)
            for n, p in m.named_parameters():
                names.setdefault(id(p), f"{path}.{n}")
        self._names[opt] = (modules.changes, names)
        return names


class _StepCode:
    """``torch.optim.Optimizer._optimizer_step_code`` wrapped while a capture runs (see
    :meth:`OptimizerSteps.install`)."""

    def __init__(self, steps: OptimizerSteps) -> None:
        self.steps = steps
        self.original = torch.optim.Optimizer.__dict__["_optimizer_step_code"]
        original = self.original

        def _optimizer_step_code(opt: Any) -> None:
            if not _compiling() and threading.get_ident() == steps.thread:
                step = steps.session.quiet
                if isinstance(step, OpenStep) and step.opt is opt:
                    steps.end(step)
            original(opt)

        _optimizer_step_code.__doc__ = original.__doc__
        self.wrapper = _optimizer_step_code
        torch.optim.Optimizer._optimizer_step_code = _optimizer_step_code  # type: ignore[method-assign, assignment]

    def remove(self) -> None:
        if torch.optim.Optimizer.__dict__.get("_optimizer_step_code") is self.wrapper:
            torch.optim.Optimizer._optimizer_step_code = self.original  # type: ignore[method-assign]
        while self.steps.handles:
            self.steps.handles.pop().remove()


class _State:
    """An optimizer's state per parameter; for a wrapper optimizer that keeps none of its own
    (``ZeroRedundancyOptimizer.optim``, a Lookahead's inner optimizer), the state of the optimizers
    it holds as attributes (one level)."""

    def __init__(self, opt: Any) -> None:
        self.own = getattr(opt, "state", None)
        self.inner = [v.state for v in vars(opt).values()
                      if isinstance(v, torch.optim.Optimizer) and v is not opt] if hasattr(opt, "__dict__") else []

    def get(self, p: Any) -> Any:
        st = self.own.get(p) if isinstance(self.own, Mapping) else None
        if st:
            return st
        for inner in self.inner:
            st = inner.get(p)
            if st:
                return st
        return None

    def values(self) -> Iterator[Any]:
        """Every parameter's state (its own and the held optimizers')."""
        for held in ([self.own] if isinstance(self.own, Mapping) else []) + self.inner:
            yield from held.values()


def _items(state: Any) -> list[tuple[str, Any]]:
    if not isinstance(state, dict):
        return []
    return [(str(k), v) for k, v in state.items()]
