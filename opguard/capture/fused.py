"""Modules PyTorch runs on a fused inference fast path, kept on it (``docs/capture.md`` §3.13).

An eval-mode ``nn.TransformerEncoder`` / ``nn.TransformerEncoderLayer`` / ``nn.MultiheadAttention``
runs fused kernels (and the encoder converts a padded batch with a ``src_key_padding_mask`` to a
nested tensor, so padded positions of its output are zeros) only when no torch function mode is
active (``torch.overrides.has_torch_function``). Under capture's mode such a module ran its standard
path instead: other kernels, other last bits, and computed values instead of zeros at padded
positions. So when such a module is called where the fast path may be taken (eval mode, PyTorch's
fast path switched on, a 3-d input, autograd off or nothing requiring grad) and capture's mode is the
innermost torch function mode, capture takes its mode off the stack for the module's forward — the
module runs exactly as without capture, fast path or not, whatever PyTorch decides — and records the
call as one record with ``api: "module"``:

* ``fn``: ``torch.nn.<Class>``; ``module``: the module's path; the call site: the program's line;
* ``inputs``: the call's tensor arguments (``arg<i>``, keywords by name), then the module's
  parameters and buffers (slot = their name inside the module: ``self_attn.in_proj_weight``);
* ``args``: the call's other arguments, and the module's configuration: each submodule's
  ``extra_repr()`` (slot ``config.<name>``: ``LayerNorm``'s eps, ``Linear``'s sizes), an encoder
  layer's ``norm_first`` and activation, an attention's ``num_heads`` and ``batch_first``;
* ``outputs``: the tensors it returned.

The calls inside it are not recorded (they are the module's implementation; modules inside it still
get their paths). A forward that raises is recorded with ``error``; one left by a ``BaseException``
that skips PyTorch's post-hooks (a Ctrl-C the program catches) is closed, and the mode put back, at
the next module call or the end of the capture.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from opguard.capture import records
from opguard.capture.mode import tensors_in
from opguard.capture.session import Call, Session

_no_modes = torch._C.DisableTorchFunction  # capture's own tensor reads skip the modes
_stack_len = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at
_pop_mode = torch._C._pop_torch_function_stack
_push_mode = torch._C._push_on_torch_function_stack

FUSED_TYPES = (torch.nn.TransformerEncoder, torch.nn.TransformerEncoderLayer, torch.nn.MultiheadAttention)


def fast_path_enabled() -> bool:
    """``torch.backends.mha.get_fastpath_enabled()`` (True where this PyTorch has no such switch)."""
    try:
        return bool(torch.backends.mha.get_fastpath_enabled())
    except AttributeError:
        return True


def _float_mask(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether an ``nn.MultiheadAttention`` call has a floating-point ``key_padding_mask`` or
    ``attn_mask`` (positions 3 and 5 of its forward, or keywords), which PyTorch's fast path refuses."""
    masks = [kwargs.get("key_padding_mask"), kwargs.get("attn_mask")]
    if isinstance(args, tuple):
        masks += [args[i] for i in (3, 5) if len(args) > i]
    return any(isinstance(t, torch.Tensor) and torch.is_floating_point(t) for t in masks)


def may_take_fast_path(m: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether PyTorch may run ``m`` (one of FUSED_TYPES) on its fast path: the conditions it checks
    before the torch function modes, as far as the global hook sees them — eval mode, the fast path
    on, a 3-d first argument, autograd off or nothing requiring grad, batch-first attention (for an
    attention module: self-attention without a floating-point mask). Where PyTorch then refuses for
    another reason, the module runs its standard path exactly as it does without capture."""
    if m.training or not fast_path_enabled():
        return False
    tensors = [a for a in args if isinstance(a, torch.Tensor)] if isinstance(args, tuple) else []
    if not tensors or tensors[0].dim() != 3:
        return False
    if torch.is_grad_enabled() and (any(t.requires_grad for t in tensors)
                                    or any(p.requires_grad for p in m.parameters())):
        return False
    if isinstance(m, torch.nn.MultiheadAttention):
        return bool(m.batch_first and len(tensors) >= 3 and tensors[0] is tensors[1] is tensors[2]
                    and not _float_mask(args, kwargs))
    layer = m.layers[0] if isinstance(m, torch.nn.TransformerEncoder) and len(m.layers) else m
    return bool(getattr(getattr(layer, "self_attn", None), "batch_first", False))


def _config(m: torch.nn.Module) -> list[tuple[str, Any]]:
    """(slot, value) of what configures ``m``'s computation beyond its tensors."""
    out: list[tuple[str, Any]] = []
    for name, sub in m.named_modules():
        rep = sub.extra_repr()
        if rep:
            out.append((f"config.{name or type(m).__name__}", rep))
        if isinstance(sub, torch.nn.TransformerEncoderLayer):
            act = sub.activation
            out.append((f"config.{name or 'layer'}.norm_first", sub.norm_first))
            out.append((f"config.{name or 'layer'}.activation",
                        getattr(act, "__name__", None) or type(act).__name__))
        elif isinstance(sub, torch.nn.MultiheadAttention):
            out.append((f"config.{name or 'attn'}.num_heads", sub.num_heads))
            out.append((f"config.{name or 'attn'}.batch_first", sub.batch_first))
    return out


@dataclass
class Fused:
    """A fused module's forward in progress."""

    module: torch.nn.Module
    frame: FrameType | None  # the frame that ran its hooks (PyTorch's Module._call_impl)
    popped: Any = None  # capture's mode, off the stack until the forward ends
    call: Call | None = None


class FusedModules:
    """Begin/end the one record of a fused module's call (called from the module hooks)."""

    def __init__(self, session: Session, mode: Any) -> None:
        self.session = session
        self.mode = mode
        self.open: Fused | None = None
        self.thread = threading.get_ident()

    def begin(self, m: torch.nn.Module, path: str, args: Any, kwargs: dict[str, Any], caller: FrameType) -> bool:
        """Take ``m``'s forward off capture's mode and begin its record; False when it runs as any
        other module (not the innermost mode: another mode would refuse the fast path without
        capture too)."""
        if self.open is not None or not (_stack_len() and _stack_at(_stack_len() - 1) is self.mode):
            return False
        f = Fused(m, caller)
        f.popped = _pop_mode()
        self.open = f
        s = self.session
        if not s.active:
            return True
        s.busy += 1
        try:
            with _no_modes():
                self._record(f, path, args, kwargs, caller)
        except Exception as err:
            s.failed("recording", err, f.call)
        finally:
            s.busy -= 1
        return True

    def _record(self, f: Fused, path: str, args: Any, kwargs: dict[str, Any], caller: FrameType) -> None:
        s, m = self.session, f.module
        name = f"torch.nn.{type(m).__name__}"
        context = "/".join(s.contexts) if s.contexts else None
        if not (s.select_all or s.selected(name, path, context)):
            return
        f.call = call = s.begin("module", name, s.sites.lookup(caller), where=(path, context))
        ins: list[tuple[str, torch.Tensor]] = []
        xs: list[dict[str, Any]] = []
        given = [(f"arg{i}", v) for i, v in enumerate(args if isinstance(args, tuple) else ())]
        for slot, value in [*given, *kwargs.items()]:
            tensors = list(tensors_in(value, slot))
            if tensors:
                ins.extend(tensors)
            else:
                xs.append(records.arg_entry(slot, value))
        ins.extend(m.named_parameters())
        ins.extend(m.named_buffers())
        xs.extend(records.arg_entry(slot, value) for slot, value in _config(m))
        call.rec["args"] = xs
        s.inputs(call, ins)
        s.parents.append(call.rec["seq"])

    def end(self, m: torch.nn.Module, out: Any, error: str | None = None) -> None:
        """``m``'s forward ended (its post-hook; ``out`` None when it raised): capture's mode goes back
        on the stack, the record gets its outputs."""
        f = self.open
        if f is None or f.module is not m:
            return
        self.open = None
        if f.popped is not None:
            _push_mode(f.popped)
            f.popped = None
        call = f.call
        if call is None:
            return
        s = self.session
        s.busy += 1
        try:
            with _no_modes():
                if s.parents and s.parents[-1] == call.rec["seq"]:
                    s.parents.pop()
                if error is not None:
                    call.rec["error"] = error[:500]
                elif not s.cap_reached:
                    s.outputs(call, list(tensors_in(out, "out")))
        except Exception as err:
            s.failed("recording", err, call)
        finally:
            s.busy -= 1
        s.maybe_flush_contained()

    def stop(self) -> None:
        """The capture is stopping inside a fused forward: capture's mode goes back on the stack (its
        exit pops itself) and the record is closed."""
        f = self.open
        if f is not None:
            self.end(f.module, None, error="the capture stopped while the forward ran")

    def settle(self, caller: FrameType | None = None) -> None:
        """Close the open record when its forward is no longer running (left by a ``BaseException``
        that skips PyTorch's post-hooks): its hook frame is not a caller of ``caller``."""
        f = self.open
        if f is None or f.frame is None:
            return
        g: FrameType | None = caller if caller is not None else sys._getframe(1)
        while g is not None:
            if g is f.frame:
                return
            g = g.f_back
        self.end(f.module, None, error="the forward did not return (an exception that skips module hooks)")
