"""Already-quantized weights (torchao tensor subclasses, bitsandbytes 4-bit) offloaded as their
packed storage.

# Note [quantized weights]
A torchao-quantized linear (int8, float8, int4, intx) holds its weight as a tensor subclass whose
values are inner tensors (`__tensor_flatten__`: `qdata`, `scale`, ...); a bitsandbytes
`Linear4bit` (QLoRA) holds a `Params4bit` of packed 4-bit bytes whose `quant_state` holds the
block scales. Neither can become an `OffloadedParameter` in place (the torchao object has no
storage of its own, and both compute through their own dispatch), so `wrap` offloads their parts:
- Each inner tensor becomes a hidden part: an `nn.Parameter` of the tensor's bytes (1-D uint8, in
  its memory order), in no module, offloaded like any frozen parameter of the scope; the bytes
  stream as they are, never dequantized, cast or compressed (`Policy` sees uint8).
- The module's weight object (its *host weight*, identity kept) gets its inner tensors replaced
  by views of those masters, so outside the forward it is the same quantized tensor on the CPU:
  `state_dict`, printing, deepcopy and `dequantize()` read the masters.
- Forward hooks on the module holding the weight (`QuantizedModuleHooks`) materialize each part
  before its forward as an op on a parameter would (OpAccess.materialize) and register a *device
  twin* in the module's `_parameters`: the same subclass rebuilt around the device views
  (`__tensor_unflatten__`; for bitsandbytes a `Params4bit` with a copied `quant_state`). After
  the forward, also when it raises, the host weight goes back. The hooks are on that module, not
  the scope's block: Hugging Face checkpointing recomputes a block's `forward` without the
  block's hooks, but calls its linears through theirs.

Autograd saves the twin (or its dequantized values) for backward like any device copy: the
twin's inner tensors share the scope's device storage, which backward loads again.

Quantized weights are frozen: `wrap` refuses one that requires grad, and so does its module's
forward when it was unfrozen later (its packed values cannot be stepped). LoRA adapters on top
are ordinary parameters.
"""

from __future__ import annotations

import copy
import enum
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..dispatch.masters import without_subclass_dispatch
from ..dispatch.slot import ParamSlot
from ..engine.failures import FailureCheck
from ..engine.hooks import Hook
from ..scopes.scope import Scope


class QuantKind(enum.Enum):
    """How a quantized weight keeps its values."""

    SUBCLASS = "tensor subclass"  # __tensor_flatten__ / __tensor_unflatten__ (torchao)
    BNB_4BIT = "bitsandbytes Params4bit"  # packed bytes in its data, scales in its quant_state


# The tensors of a bitsandbytes QuantState, by attribute path from the Params4bit; the nested
# state (compress_statistics) under `state2`. `offset` and `state2` may be None.
_BNB_PATHS = (("quant_state", "absmax"), ("quant_state", "code"), ("quant_state", "offset"),
              ("quant_state", "state2", "absmax"), ("quant_state", "state2", "code"))


def quant_kind(p: torch.Tensor) -> QuantKind | None:
    """What kind of quantized weight `p` is, or None for an ordinary tensor."""
    if is_traceable_wrapper_subclass(p):
        return QuantKind.SUBCLASS
    if type(p).__name__ == "Params4bit" and hasattr(p, "quant_state"):
        return QuantKind.BNB_4BIT
    return None


@dataclass(eq=False)
class Part:
    """One inner tensor of a quantized weight, offloaded as the bytes of a hidden parameter."""

    path: tuple[str, ...]  # attribute path from the weight object (nested subclasses included)
    hidden: nn.Parameter  # 1-D uint8, its bytes; an OffloadedParameter once the scope is built
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]

    @property
    def slot(self) -> ParamSlot:
        return self.hidden._ot  # type: ignore[attr-defined]

    def typed(self, flat: torch.Tensor) -> torch.Tensor:
        """The inner tensor as a view of its bytes `flat` (host master or device copy)."""
        return flat.view(self.dtype).as_strided(self.shape, self.stride)


@dataclass(eq=False)
class QuantizedWeight:
    """One quantized weight of a scope: its host object, its parts, its device twins."""

    name: str  # qualified name in the wrapped model
    kind: QuantKind
    host: torch.Tensor  # the object the module holds outside its forward; inner tensors on the masters
    parts: list[Part] = field(default_factory=list)

    def bind_host(self) -> None:
        """Point the host weight's inner tensors at the masters (after the scope is built)."""
        masters = {part.path: part.typed(part.slot.master) for part in self.parts}
        if self.kind is QuantKind.BNB_4BIT:
            for path, t in masters.items():
                _set_path(self.host, path, t)
            return
        # A wrapper subclass reports the device it was made on: one quantized on the GPU is
        # rebuilt on the masters and swapped into the same Python object (identity kept).
        rebuilt = _unflatten(self.host, (), masters)
        for key, value in self.host.__dict__.items():
            rebuilt.__dict__.setdefault(key, value)  # `_is_param`, attributes set by the user
        torch.utils.swap_tensors(self.host, rebuilt)

    def restore(self) -> None:
        """offtensor.unwrap: inner tensors on plain CPU memory of their own, copies of the masters."""
        for part in self.parts:
            _set_path(self.host, part.path, part.typed(part.slot.master).clone())
        _registry.pop(id(self.host), None)

    def twin(self, op_device: torch.device | None) -> torch.Tensor:
        """What the module's forward gets: the device twin, or the host weight where an op on a
        master would act on the master (OpAccess.materialize says None)."""
        got = without_subclass_dispatch(_materialize, self.parts, op_device)
        if any(t is None for t in got):
            return self.host
        inner = {part.path: part.typed(t) for part, t in zip(self.parts, got, strict=True)}
        if self.kind is QuantKind.BNB_4BIT:
            return _bnb_twin(self.host, inner)
        twin = _unflatten(self.host, (), inner)
        if isinstance(self.host, nn.Parameter):
            twin._is_param = True  # type: ignore[attr-defined]  # isinstance(w, nn.Parameter), as the host
        return twin


def _materialize(parts: list[Part], op_device: torch.device | None) -> list[torch.Tensor | None]:
    """Each part's tensor for an op on `op_device`, as for an op on an offloaded parameter."""
    return [part.slot.scope.materialize(part.slot, op_device) for part in parts]


# id(host weight) -> its QuantizedWeight while offloaded; weak, as the model's hooks and hidden
# parameters hold it (an id reused after the model is gone is told apart by `host`).
_registry: dict[int, weakref.ref[QuantizedWeight]] = {}


def offloaded_weight(p: Any) -> QuantizedWeight | None:
    """The QuantizedWeight of an offloaded quantized host weight, else None."""
    ref = _registry.get(id(p)) if isinstance(p, torch.Tensor) else None
    qw = ref() if ref is not None else None
    return qw if qw is not None and qw.host is p else None


def quantized_parts(qual: str, p: torch.Tensor) -> list[tuple[str, nn.Parameter]]:
    """`wrap`: the hidden parameters to offload in place of quantized weight `p`, by name
    (`<weight>.<inner path>`); `p` is registered as offloaded (Note [quantized weights])."""
    kind = quant_kind(p)
    assert kind is not None
    if offloaded_weight(p) is not None:
        raise RuntimeError(
            f"offtensor.wrap: quantized parameter {qual!r} is already offloaded by another "
            "offtensor.wrap call (on a parent or submodule); call offtensor.unwrap on that model first"
        )
    if p.requires_grad:
        raise ValueError(
            f"offtensor.wrap: quantized parameter {qual!r} ({type(p).__name__}) requires grad; "
            "offtensor streams quantized weights frozen only (their packed values cannot be "
            "stepped). Freeze it with requires_grad_(False) and train adapters on top "
            "(peft.get_peft_model does both)"
        )
    if p.is_meta:
        raise ValueError(f"offtensor.wrap: quantized parameter {qual!r} is on the meta device; "
                         "quantize a model that holds its weights, then wrap it")
    unquantized = getattr(p, "quant_state", None) is None or not getattr(p, "bnb_quantized", True)
    if kind is QuantKind.BNB_4BIT and unquantized:
        raise ValueError(
            f"offtensor.wrap: bitsandbytes parameter {qual!r} is not quantized yet (no "
            "quant_state): bitsandbytes quantizes a Linear4bit when it is moved, so call "
            "model.to('cpu') or model.cuda() (or load it with from_pretrained and "
            "BitsAndBytesConfig(load_in_4bit=True)) before offtensor.wrap"
        )
    paths = _subclass_paths(p, ()) if kind is QuantKind.SUBCLASS else [("data",), *(
        path for path in _BNB_PATHS if isinstance(_get_path(p, path), torch.Tensor))]
    qw = QuantizedWeight(qual, kind, p)
    named = []
    for path in paths:
        inner = _get_path(p, path).detach()
        if is_traceable_wrapper_subclass(inner) or inner.is_meta:
            raise TypeError(f"offtensor.wrap: quantized parameter {qual!r} holds {'.'.join(path)}, a "
                            f"{type(inner).__name__} offtensor cannot offload (not a plain tensor)")
        if not _dense(inner):
            inner = inner.contiguous()
        nbytes = inner.numel() * inner.element_size()
        raw = inner.as_strided((inner.numel(),), (1,))  # its elements in memory order
        hidden = nn.Parameter(raw.view(torch.uint8) if nbytes else raw.new_empty(0, dtype=torch.uint8),
                              requires_grad=False)
        hidden._ot_weight = qw  # type: ignore[attr-defined]  # weights_of(scope) finds it
        qw.parts.append(Part(path, hidden, inner.dtype, inner.shape, inner.stride()))
        named.append((f"{qual}.{'.'.join(path)}", hidden))
    _registry[id(p)] = weakref.ref(qw)
    return named


def weights_of(scope: Scope) -> list[QuantizedWeight]:
    """The quantized weights whose parts the scope offloads."""
    found: dict[int, QuantizedWeight] = {}
    for slot in scope.slots:
        qw = getattr(slot.param, "_ot_weight", None)
        if qw is not None:
            found[id(qw)] = qw
    return list(found.values())


def attach(scope: Scope) -> list[torch.utils.hooks.RemovableHandle]:
    """After the scope is built: bind each quantized weight's host object to the masters and
    hook the modules holding it (Note [quantized weights]). Returns the hook handles."""
    weights = weights_of(scope)
    for qw in weights:
        qw.bind_host()
    handles = []
    by_id = {id(qw.host): qw for qw in weights}
    for module in scope.module.modules():
        held = [(key, by_id[id(p)]) for key, p in module._parameters.items() if p is not None and id(p) in by_id]
        if held:
            hooks = QuantizedModuleHooks(held)
            handles.append(module.register_forward_pre_hook(Hook(hooks.pre), with_kwargs=True))
            handles.append(module.register_forward_hook(Hook(hooks.post), with_kwargs=True, always_call=True))
            handles.append(module.register_load_state_dict_pre_hook(Hook(functools.partial(_before_load, held))))
    return handles


class QuantizedModuleHooks:
    """The forward hooks of one module holding quantized weights: device twins in, host weights
    back (Note [quantized weights])."""

    def __init__(self, held: list[tuple[str, QuantizedWeight]]) -> None:
        self.held = held  # (key in module._parameters, weight)
        self.calls = FailureCheck()  # tells which calls a KeyboardInterrupt ended without `post`
        self.depth = 0  # calls in progress (post runs also when the forward or a pre-hook raises)
        self.placed: dict[str, torch.Tensor] = {}  # the twins the outermost call registered, by key

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        interrupted = self.calls.enter()
        if interrupted:
            self.depth -= interrupted
            if self.depth == 0:
                self._put_back(module)  # the interrupted calls left their twins
        self.depth += 1
        if self.depth > 1:
            return  # a nested call of the same module: the outer call's twins serve
        device = _op_device((args, kwargs))
        for key, qw in self.held:
            if module._parameters.get(key) is not qw.host:
                raise RuntimeError(
                    f"offtensor: quantized parameter {qw.name!r} was replaced after offtensor.wrap "
                    f"(it is now a {type(module._parameters.get(key)).__name__}); the offloaded "
                    "weight would be used instead. Call offtensor.unwrap(model), change the "
                    "weight, then wrap again"
                )
            if qw.host.requires_grad:
                raise RuntimeError(
                    f"offtensor: quantized parameter {qw.name!r} requires grad, but offtensor "
                    "streams quantized weights frozen only (their packed values cannot be "
                    "stepped). Call requires_grad_(False) on it and train adapters on top"
                )
        params: dict[str, Any] = module._parameters
        for key, qw in self.held:
            params[key] = self.placed[key] = qw.twin(device)

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.calls.failed()  # pops this call's record
        self.depth -= 1
        if self.depth == 0:
            self._put_back(module)

    def _put_back(self, module: nn.Module) -> None:
        params: dict[str, Any] = module._parameters
        placed, self.placed = self.placed, {}
        for key, qw in self.held:
            if key in placed and params.get(key) is placed[key]:  # not what the user put there since
                params[key] = qw.host


def _before_load(held: list[tuple[str, QuantizedWeight]], module: nn.Module, state_dict: dict, prefix: str,
                 local_metadata: dict, *args: object) -> None:
    """load_state_dict pre-hook: the masters are about to be written (device copies of them
    are stale), and `assign=True` would replace the host weight: values are copied instead."""
    for _, qw in held:
        for part in qw.parts:
            part.slot.scope.before_master_write(part.slot)
    local_metadata["assign_to_params_buffers"] = False


def _op_device(tree: Any) -> torch.device | None:
    """The accelerator device of the forward's input tensors, None when all are on the CPU."""
    for t in torch.utils._pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            return t.device
    return None


def _dense(t: torch.Tensor) -> bool:
    """Its elements fill `numel` consecutive places of its storage (some order of its dims is
    contiguous): its bytes can be copied as they lie, and viewed back with its strides."""
    order = sorted(range(t.dim()), key=lambda d: t.stride(d), reverse=True)
    return t.permute(order).is_contiguous()


def _subclass_paths(t: Any, prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The attribute paths of a tensor subclass's plain inner tensors (recursing into nested
    subclasses)."""
    names, _ = t.__tensor_flatten__()
    paths: list[tuple[str, ...]] = []
    for name in names:
        inner: Any = getattr(t, name)
        paths.extend(_subclass_paths(inner, (*prefix, name)) if is_traceable_wrapper_subclass(inner)
                     else [(*prefix, name)])
    return paths


def _unflatten(t: Any, prefix: tuple[str, ...], inner: dict[tuple[str, ...], torch.Tensor]) -> torch.Tensor:
    """The subclass `t` rebuilt around the tensors `inner` (by path), nested subclasses too."""
    names, ctx = t.__tensor_flatten__()
    tensors = {}
    for name in names:
        sub: Any = getattr(t, name)
        path = (*prefix, name)
        tensors[name] = _unflatten(sub, path, inner) if is_traceable_wrapper_subclass(sub) else inner[path]
    return type(t).__tensor_unflatten__(tensors, ctx, t.shape, t.stride())


def _bnb_twin(host: torch.Tensor, inner: dict[tuple[str, ...], torch.Tensor]) -> torch.Tensor:
    """A Params4bit on the device views, with a copy of the host's quant_state pointing at them."""
    twin = torch.Tensor._make_subclass(type(host), inner[("data",)], False)
    twin.__dict__.update(host.__dict__)
    state = copy.copy(host.quant_state)  # type: ignore[attr-defined]
    if state.state2 is not None:
        state.state2 = copy.copy(state.state2)
    twin.quant_state = state  # type: ignore[attr-defined]
    for path, t in inner.items():
        if path != ("data",):
            _set_path(twin, path, t)
    return twin


def _get_path(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        obj = getattr(obj, name, None) if obj is not None else None
    return obj


def _set_path(obj: Any, path: tuple[str, ...], value: torch.Tensor) -> None:
    target = _get_path(obj, path[:-1])
    if path == ("data",):
        # Params4bit: its storage becomes the master's (`.data =` keeps the object and class).
        torch._C.TensorBase.data.__set__(target, value)  # type: ignore[attr-defined]
    else:
        setattr(target, path[-1], value)
