"""The guards on a wrapped model: the calls that would take a master out of its scope's host
buffer are refused or turned into copies. Moving and converting (`Module._apply`),
`load_state_dict(assign=True)`, and replacing an offloaded parameter. (Pickling and deep copies
give plain Parameters: `OffloadedParameter.__reduce_ex__` and `__deepcopy__` in dispatch/param.py.)

# Note [moving a wrapped model]
`model.cuda()`, `.to(device)` and `.half()` reach parameters through `Module._apply`, which
rebinds `param.data` to the converted tensor: that would silently move an offloaded master to
the device (and copy the whole model there). `wrap` therefore gives every module with an
offloaded parameter in its subtree (the wrapped model itself included) an instance-level
`_apply`. It first probes the conversion on an empty tensor of each dtype the subtree's masters
have: a dtype change is refused there, before anything changes, because the masters' dtype fixes
the scope's buffer layout. So is `share_memory()` (a probe that comes back in shared memory):
the masters cannot leave the scope's host buffer, and other processes would train copies of
them. Checking the subtree, not only the module's own parameters, matters:
`Module._apply` converts the children one after the other, so a check per module would raise
only after the modules before it (an embedding, a head) were converted, leaving a model of mixed
dtypes. Device moves then apply to everything else (buffers, unwrapped parameters) while the
guarded module hides the masters of its whole subtree from the conversion, leaving them on the
host: a module that got an offloaded parameter after wrap (a head tied to an offloaded
embedding by `tie_weights()`) has no guard of its own, and `Module._apply` would convert its
master like a plain parameter. (A module that merely contains the wrapped model is not
guarded: converting it may convert its other children before the wrapped model refuses.)

# Note [loading with assign=True]
`load_state_dict(sd, assign=True)` replaces each parameter by the state dict's tensor: offloaded
parameters would become plain ones that no scope loads, in a model that is still wrapped. Each
module with offloaded parameters in its subtree therefore has a load_state_dict pre-hook. When
`assign` is set (PyTorch passes it to `_load_from_state_dict` as
`local_metadata["assign_to_params_buffers"]`), it checks that the state dict's tensors for the
subtree's offloaded parameters have their shapes and dtypes (the outermost module checks before
anything is loaded) and, on a module holding offloaded parameters itself, turns `assign` off:
the values are copied into the masters, and that module's buffers and other parameters are
copied too, as with `assign=False`.

# Note [replacing an offloaded parameter]
`module.weight = nn.Parameter(t)` after wrap, or tying a scope's parameter to another one
(`tie_weights()` on a selected head), would register a plain parameter in the scope, never
offloaded (resident on the device, or PyTorch's device-mismatch error once the inputs are
there), while the old master would stay in the scope's buffer, loaded at each call:
the scope's layout is fixed at wrap. A parameter registration hook (`Module.register_parameter`,
which `setattr` uses, calls it for every module) refuses to replace a live offloaded parameter
by another object, before anything changes, naming it and the ways to do it: copy the values
in, or unwrap, change the model and wrap again. Registering the same parameter again, new
parameters (adapters added after wrap, plain ones) and moving one under another name (prune's
`weight_orig`, parametrizations' `original`) are unaffected; so is code that writes
`module._parameters` directly (accelerate's `set_module_tensor_to_device`, which gives a plain
parameter, and torch.func's `functional_call`, which puts the originals back).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .. import patches
from ..dispatch.masters import without_subclass_dispatch
from ..dispatch.param import OffloadedParameter
from ..engine.engine import Engine
from ..engine.hooks import Hook
from .quantized import offloaded_weight


def _refuse_replacing(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Global parameter registration hook: see Note [replacing an offloaded parameter]."""
    old = module._parameters.get(name)
    if old is param or not isinstance(old, OffloadedParameter) or getattr(old, "_ot", None) is None:
        return
    slot = old._ot
    raise RuntimeError(
        f"offtensor: cannot replace offloaded parameter {slot.name!r} of scope "
        f"{slot.scope.name!r} by another {type(param).__name__} after offtensor.wrap: the new one "
        "would not be offloaded, and the old master would still be loaded; nothing was changed. "
        f"To change its values, copy them in (with torch.no_grad(): module.{name}.copy_(new), "
        "same shape and dtype); to change its shape or tie it to another parameter, call "
        "offtensor.unwrap(model), change the model, then wrap it again"
    )


def guard(model: nn.Module, engine: Engine) -> None:
    """Guard `_apply` (Note [moving a wrapped model]) and `load_state_dict(assign=True)` (Note
    [loading with assign=True]) on each module with offloaded parameters in its subtree, and
    parameter registrations everywhere (Note [replacing an offloaded parameter])."""
    patches.parameter_registration_hook(_refuse_replacing)  # once per process: it checks every module
    for module in model.modules():
        if any(isinstance(p, OffloadedParameter) or offloaded_weight(p) for p in module.parameters()):
            module._apply = functools.partial(_apply_keeping_masters, module)  # type: ignore[method-assign]
            engine.guard_handles.append(module.register_load_state_dict_pre_hook(Hook(_load_into_masters)))


def _offloaded_in(module: nn.Module, recurse: bool = True) -> list[tuple[str, OffloadedParameter]]:
    """The offloaded parameters of `module` (with `recurse`, of its subtree), by state dict key;
    a tied parameter once per key."""
    return [(name, p) for name, p in module.named_parameters(recurse=recurse, remove_duplicate=False)
            if isinstance(p, OffloadedParameter) and getattr(p, "_ot", None) is not None]


def _dtype_of(p: torch.Tensor) -> torch.dtype:
    return p.dtype


def _shape_dtype_of(p: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    return p.shape, p.dtype


def _apply_keeping_masters(module: nn.Module, fn, recurse: bool = True):
    """Module._apply that refuses dtype changes of offloaded masters before converting anything
    and leaves the masters alone; see Note [moving a wrapped model]."""
    first_of_dtype: dict[torch.dtype, str] = {}
    for _, p in _offloaded_in(module, recurse):
        first_of_dtype.setdefault(without_subclass_dispatch(_dtype_of, p), p._ot.name)
    for q in module.parameters(recurse=recurse):
        weight = offloaded_weight(q)  # its logical dtype (Note [quantized weights])
        if weight is not None:
            first_of_dtype.setdefault(q.dtype, weight.name)
    for dtype, name in first_of_dtype.items():
        try:
            probe = fn(torch.empty(0, dtype=dtype))
        except (RuntimeError, AssertionError, TypeError, ValueError):
            # fn does not apply to a CPU probe: a move to a device this machine lacks
            # (torch raises AssertionError when it was built without CUDA), a custom fn
            continue
        if isinstance(probe, torch.Tensor) and probe.device.type == "cpu" and probe.is_shared():
            # `model.share_memory()`: hidden from the conversion below, the masters would stay
            # private to this process, and processes that fork after it (Hogwild) would each
            # train a copy of their own, silently.
            raise RuntimeError(
                f"offtensor: cannot move offloaded parameter {name!r} to shared memory "
                "(model.share_memory()): the masters of a wrapped model stay in their scopes' host "
                "buffers, so nothing was moved. For several processes, use "
                "offtensor.data_parallel(model, shard_optimizer=True), whose ranks share one host "
                "copy; or call offtensor.unwrap(model) first"
            )
        if isinstance(probe, torch.Tensor) and probe.dtype != dtype:
            raise TypeError(
                f"offtensor: cannot convert offloaded parameter {name!r} from {dtype} "
                f"to {probe.dtype}: the masters of a wrapped model keep their dtype, so nothing "
                "was converted. Convert before offtensor.wrap(model), wrap with "
                f"offtensor.Policy(compute_dtype={probe.dtype}) to compute in it from these "
                "masters (for transformers' Trainer: instead of bf16_full_eval/fp16_full_eval), "
                "or call offtensor.unwrap(model) first. (Device moves such as "
                "model.to('cuda') are fine: they leave the masters on the host.)"
            )
    # The whole subtree's masters, not only the module's own: a module given an offloaded
    # parameter after wrap (a head tied to an offloaded embedding by tie_weights(), a Linear
    # rebuilt around its weight) has no guard of its own.
    masters = [(m._parameters, k, p) for m in (module.modules() if recurse else (module,))
               for k, p in m._parameters.items()
               if isinstance(p, OffloadedParameter) or offloaded_weight(p) is not None]
    for params, key, _ in masters:
        params[key] = None
    try:
        return type(module)._apply(module, fn, recurse)
    finally:
        for params, key, master in masters:
            params[key] = master


def _load_into_masters(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
                       *args: object) -> None:
    """load_state_dict pre-hook: with `assign=True`, check the offloaded parameters' entries and
    copy them into the masters instead (Note [loading with assign=True])."""
    if torch.__future__.get_swap_module_params_on_conversion():
        # Module._load_from_state_dict would swap each parameter object's contents for the state
        # dict's tensor: the offloaded parameters would become plain ones (on the state dict's
        # device) that no scope loads, silently.
        loaded = [name for name, _ in _offloaded_in(module) if prefix + name in state_dict]
        if loaded:
            raise RuntimeError(
                f"offtensor: load_state_dict under "
                f"torch.__future__.set_swap_module_params_on_conversion(True) would swap "
                f"offloaded parameter {prefix + loaded[0]!r} for the state dict's tensor, which "
                "ends its offloading; nothing was loaded. Turn swapping off around "
                "load_state_dict (set_swap_module_params_on_conversion(False)): the values are "
                "then copied into the masters"
            )
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    for name, p in _offloaded_in(module):
        value = state_dict.get(prefix + name)
        if not isinstance(value, torch.Tensor):
            continue  # missing, or not a tensor: load_state_dict reports it
        shape, dtype = without_subclass_dispatch(_shape_dtype_of, p)
        if value.shape != shape or value.dtype != dtype:
            raise TypeError(
                f"offtensor: load_state_dict(assign=True) cannot load {prefix + name!r}, a tensor "
                f"of shape {tuple(value.shape)} and dtype {value.dtype}, into offloaded parameter "
                f"{p._ot.name!r} ({tuple(shape)}, {dtype}): a wrapped model keeps its offloaded "
                "parameters and copies the values into them, so shapes and dtypes must match. "
                f"Nothing in {prefix[:-1] or 'the model'!r} was loaded. Convert the state "
                "dict's tensors, or call offtensor.unwrap(model) first"
            )
    if any(isinstance(p, OffloadedParameter) for p in module._parameters.values()):
        local_metadata["assign_to_params_buffers"] = False


def remove_guards(top: nn.Module) -> None:
    """Take the `_apply` guards off `top`'s modules (the load_state_dict pre-hooks are in
    `engine.guard_handles`, removed with the engine's other handles)."""
    for module in top.modules():
        guard = module.__dict__.get("_apply")
        if isinstance(guard, functools.partial) and guard.func is _apply_keeping_masters:
            del module.__dict__["_apply"]
