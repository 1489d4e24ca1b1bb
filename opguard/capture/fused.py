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

from opguard.capture import modestack, records
from opguard.capture.mode import tensors_in
from opguard.capture.session import Call, Session

_no_modes = torch._C.DisableTorchFunction  # capture's own tensor reads skip the modes (the program's too)

FUSED_TYPES = (torch.nn.TransformerEncoder, torch.nn.TransformerEncoderLayer, torch.nn.MultiheadAttention)


def fast_path_enabled() -> bool:
    """``torch.backends.mha.get_fastpath_enabled()`` (True where this PyTorch has no such switch)."""
    try:
        return bool(torch.backends.mha.get_fastpath_enabled())
    except AttributeError:
        return True


def _arg(args: Any, kwargs: dict[str, Any], i: int, name: str) -> Any:
    """Argument ``name`` of a module call, ``i``-th positional or by keyword."""
    if isinstance(args, tuple) and len(args) > i:
        return args[i]
    return kwargs.get(name)


def _float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and torch.is_floating_point(t)


def _needs_grad(tensors: list[Any]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def candidate(m: torch.nn.Module) -> bool:
    """A module whose fast path capture checks further (its keyword arguments read only then):
    an instance of FUSED_TYPES in eval mode (an encoder: its first layer)."""
    if not isinstance(m, FUSED_TYPES):
        return False
    if isinstance(m, torch.nn.TransformerEncoder):
        return bool(len(m.layers)) and not m.layers[0].training
    return not m.training


def may_take_fast_path(m: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether PyTorch may run ``m`` (an instance of FUSED_TYPES) on a fast path: the conditions it
    checks besides the torch function modes, the ones capture cannot know exactly (mask contents,
    dtypes, devices) left out — so this holds wherever PyTorch takes the path without capture, and
    where it then refuses for another reason the module runs its standard path exactly as it does
    without capture. Read under no torch function mode (none of the program's modes sees it). A
    module with forward pre-hooks of its own (which can reshape the input) is not judged by its input."""
    if not fast_path_enabled():
        return False
    with _no_modes():
        hooked = bool(getattr(m, "_forward_pre_hooks", None))
        if isinstance(m, torch.nn.MultiheadAttention):
            q, k, v = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key"), _arg(args, kwargs, 2, "value")
            if not isinstance(q, torch.Tensor) or m.training or not m.batch_first:
                return False
            if not hooked and (q.dim() != 3 or not (q is k is v)):
                return False
            if (m.bias_k is not None or m.bias_v is not None or m.add_zero_attn or not m._qkv_same_embed_dim
                    or m.in_proj_weight is None or m.num_heads % 2 or torch.is_autocast_enabled()):
                return False
            if _float(_arg(args, kwargs, 3, "key_padding_mask")) or _float(_arg(args, kwargs, 5, "attn_mask")):
                return False
            return not _needs_grad([q, k, v, *m.parameters()])
        src = _arg(args, kwargs, 0, "src")
        if not isinstance(src, torch.Tensor):
            return False
        if isinstance(m, torch.nn.TransformerEncoder):
            # its nested-tensor conversion: PyTorch judges it by the first layer (the layers then judge
            # themselves, each at its own call)
            if not len(m.layers) or not getattr(m, "use_nested_tensor", False):
                return False
            layer = m.layers[0]
            if (layer.training or _arg(args, kwargs, 2, "src_key_padding_mask") is None
                    or _arg(args, kwargs, 1, "mask") is not None or torch.is_autocast_enabled()):
                return False
            if not hooked and src.dim() != 3:
                return False
            return not _needs_grad([src, *layer.parameters()])
        attn = getattr(m, "self_attn", None)
        if m.training or attn is None or not attn.batch_first or (not hooked and src.dim() != 3):
            return False
        return not _needs_grad([src, *m.parameters()])


# a module's own hook tables (forward, pre-forward, backward, pre-backward)
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _config(m: torch.nn.Module) -> list[tuple[str, Any]]:
    """(slot, value) of what configures ``m``'s computation beyond its tensors (``<name>``: a
    submodule's name inside ``m``, the class name for ``m`` itself)."""
    out: list[tuple[str, Any]] = []
    for name, sub in m.named_modules():
        label = f"config.{name or type(m).__name__}"
        rep = sub.extra_repr()
        if rep:
            out.append((label, rep))
        hooks = sum(len(getattr(sub, h, None) or ()) for h in _MODULE_HOOKS)
        if hooks:  # the program's own hooks run inside the record, unrecorded
            out.append((f"{label}.hooks", hooks))
        if isinstance(sub, torch.nn.TransformerEncoder):
            for key in ("enable_nested_tensor", "use_nested_tensor", "mask_check"):
                out.append((f"{label}.{key}", getattr(sub, key, None)))
        elif isinstance(sub, torch.nn.TransformerEncoderLayer):
            act = sub.activation
            out.append((f"{label}.norm_first", sub.norm_first))
            out.append((f"{label}.activation", getattr(act, "__name__", None) or type(act).__name__))
        elif isinstance(sub, torch.nn.MultiheadAttention):
            out.append((f"{label}.num_heads", sub.num_heads))
            out.append((f"{label}.batch_first", sub.batch_first))
    return out


@dataclass
class Fused:
    """A fused module's forward in progress."""

    module: torch.nn.Module
    frame: FrameType | None  # the frame that ran its hooks (PyTorch's Module._call_impl)
    taken: modestack.Taken | None = None  # capture's mode, off the stack until the forward ends
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
        if self.open is not None or not modestack.innermost(self.mode):
            return False
        f = Fused(m, caller)
        f.taken = modestack.take_off(self.mode)
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
        if f.taken is not None:
            modestack.put_back(f.taken)
            f.taken = None
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
