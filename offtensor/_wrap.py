"""The public entry points: wrap, unwrap, is_wrapped, summary.

# Note [moving a wrapped model]
`model.cuda()`, `.to(device)` and `.half()` reach parameters through `Module._apply`, which
rebinds `param.data` to the converted tensor: that would silently move an offloaded master to
the device (and copy the whole model there). `wrap` therefore gives every module that holds an
offloaded parameter an instance-level `_apply` that hides those parameters from the conversion:
device moves apply to everything else (buffers, unwrapped parameters) and leave the masters on
the host; a dtype change is refused before anything of that module changes, because the masters'
dtype fixes the scope's buffer layout.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, cast

import torch
from torch import nn

from ._api import Policy, ScopeState, ScopeSummary, Summary
from ._host_memory import PinProgress, host_empty
from ._overlap import wait_for_steps
from ._param import OffloadedParameter, without_subclass_dispatch
from ._scope import ALIGN, DeviceCopy, FailureCheck, Hook, ParamSlot, Scope
from ._transfer import TransferEngine

logger = logging.getLogger("offtensor")

Predicate = Callable[[str, nn.Module], "bool | Policy"]
_ENGINE_ATTR = "_offtensor_engine"


def wrap(model: nn.Module, predicate: Predicate | None = None, *,
         device: torch.device | str | None = None, policy: Policy | None = None) -> nn.Module:
    """Offload the parameters of selected modules to host memory, streaming them to `device`.

    Each module that `predicate` selects becomes a *scope*: its parameters (recursively) become
    `OffloadedParameter`s whose masters live in one flat host buffer (pinned on CUDA). When the
    scope's forward starts, its parameters are copied to the device as one transfer (the next
    scopes are prefetched on a side stream while it computes); when the forward ends the device
    copy is freed. In backward the scope is loaded again, gradients are copied to the host as
    they are produced and accumulate into `p.grad` on the CPU, so a standard `torch.optim`
    optimizer steps the host masters. Works with `torch.utils.checkpoint` (reentrant or not)
    and Hugging Face `gradient_checkpointing_enable()`. Modules not selected are left alone:
    place them yourself (`model.to(device)` after `wrap` moves them and the buffers and keeps
    the offloaded masters on the host).

    Args:
        model: the model, modified in place. Parameters keep their identity (an optimizer built
            before `wrap` stays valid); their data moves into the host buffers.
        predicate: `predicate(qualified_name, module) -> bool | Policy` selects scopes;
            returning a `Policy` selects the module with that policy. Default: every element of
            every `nn.ModuleList` (the decoder layers of a transformer, the blocks of a UNet).
            A selected module's descendants are part of it and must not be selected too.
        device: the compute device. Default: the current CUDA device if available, else
            `"cpu"`; `"cpu"` runs the same mechanism with CPU copies (used to test it).
        policy: options (prefetch depth, keep-for-backward, pinning); default `Policy()`.

    Returns:
        `model`.

    Example::

        model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)
        offtensor.wrap(model)                      # decoder layers offloaded
        model.to("cuda")                           # embeddings, norm, head on the GPU
        model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad()
    """
    policy = policy if policy is not None else Policy()
    if not isinstance(policy, Policy):
        raise TypeError(f"offtensor.wrap: policy must be an offtensor.Policy, got {type(policy).__name__}")
    device = _resolve_device(device)
    if is_wrapped(model):
        raise RuntimeError(
            f"offtensor.wrap: this {type(model).__name__} is already wrapped "
            f"({len(getattr(model, _ENGINE_ATTR).scopes)} scopes); call offtensor.unwrap(model) "
            "first, then wrap it again with the new predicate or policy"
        )
    already = [n for n, p in model.named_parameters() if isinstance(p, OffloadedParameter)]
    if already:
        raise RuntimeError(
            f"offtensor.wrap: parameter {already[0]!r} is already offloaded by another "
            "offtensor.wrap call (on a parent or submodule); call offtensor.unwrap on that model first"
        )
    selected = _select(model, predicate, policy)
    _check_selection(model, selected)

    pin = policy.pin_memory if policy.pin_memory is not None else device.type == "cuda"
    if pin and not torch.cuda.is_available():
        raise ValueError("offtensor.wrap: Policy(pin_memory=True) needs CUDA; this machine has none")
    engine = TransferEngine(device, policy)
    owned: set[int] = set()
    plans = []
    for name, module, scope_policy, recurse, block in _split_large(selected):
        params = []
        for pname, p in module.named_parameters(recurse=recurse):
            qual = f"{name}.{pname}" if name else pname
            keep = scope_policy.param_filter is None or scope_policy.param_filter(qual, p)
            if keep and id(p) not in owned:
                owned.add(id(p))
                params.append((qual, p))
        if params:
            plans.append((name, module, scope_policy, params, block))
    if not plans:
        raise ValueError(
            f"offtensor.wrap: the predicate selected {len(selected)} modules (e.g. "
            f"{selected[0][0]!r}) but Policy.param_filter kept none of their parameters; with "
            "offtensor.frozen_only, freeze the base weights (requires_grad_(False), or "
            "peft.get_peft_model) before wrapping"
        )
    progress = PinProgress(sum(p.numel() * p.element_size() for *_, params, _ in plans for _, p in params))
    try:
        for name, module, scope_policy, params, block in plans:
            scope = Scope(name, module, scope_policy, engine, pinned=pin, block=block)
            _offload_params(scope, params, device)
            progress.advance(scope.nbytes)
            scope.install_hooks()
            engine.scopes.append(scope)
    finally:
        progress.close()
    engine.scopes_ready()
    _hook_model_forward(model, engine)
    _guard_apply(model)
    setattr(model, _ENGINE_ATTR, engine)
    logger.debug("wrapped %d scopes (%.1f MiB) computing on %s", len(engine.scopes),
                 sum(s.nbytes for s in engine.scopes) / 2**20, device)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Undo `wrap`: plain `nn.Parameter`s on the CPU (same objects, data and `.grad` kept),
    hooks removed, device copies freed. The model can then be moved or wrapped again."""
    engine = _engine_of(model)
    wait_for_steps()  # a deferred optimizer step may still write the masters
    engine.release_all()
    for handle in engine.handles:
        handle.remove()
    for scope in engine.scopes:
        scope.remove_hooks()
        without_subclass_dispatch(_restore_params, scope)
    for module in model.modules():
        module.__dict__.pop("_apply", None)
    delattr(model, _ENGINE_ATTR)
    return model


def _restore_params(scope: Scope) -> None:
    """The scope's parameters become plain nn.Parameters again (subclass dispatch off)."""
    for slot in scope.slots:
        p = slot.param
        grad = p.grad
        data = p.detach().clone()
        p.grad = None
        del p._ot
        p.__class__ = nn.Parameter  # type: ignore[assignment]
        p.data = data
        if grad is not None:
            p.grad = grad.clone()


def is_wrapped(model: nn.Module) -> bool:
    return getattr(model, _ENGINE_ATTR, None) is not None


def summary(model: nn.Module) -> Summary:
    """What each scope holds on the host and on the device right now."""
    engine = _engine_of(model)
    rows = [
        ScopeSummary(s.name, s.state, s.num_params(), s.host_bytes(), s.device_bytes(), s.loads,
                     s.loads_on_demand)
        for s in engine.scopes
    ]
    allocated = torch.cuda.memory_allocated(engine.device) if engine.is_cuda else None
    return Summary(str(engine.device), rows, allocated)


def _engine_of(model: nn.Module) -> TransferEngine:
    engine = getattr(model, _ENGINE_ATTR, None)
    if engine is None:
        raise ValueError(f"offtensor: this {type(model).__name__} is not wrapped; call offtensor.wrap(model) first")
    return engine


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("offtensor.wrap: device='cuda' requested but CUDA is not available; use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"offtensor.wrap: device {device} is not supported; use 'cuda' or 'cpu'")
    return device


def _select(model: nn.Module, predicate: Predicate | None, policy: Policy) -> list[tuple[str, nn.Module, Policy]]:
    selected = []
    if predicate is None:
        for name, module in model.named_modules():
            if isinstance(module, nn.ModuleList):
                for i, child in enumerate(module):
                    selected.append((f"{name}.{i}" if name else str(i), child, policy))
        return selected
    for name, module in model.named_modules():
        choice = predicate(name, module)
        if isinstance(choice, Policy):
            selected.append((name, module, choice))
        elif choice:
            selected.append((name, module, policy))
    return selected


def _split_large(selected: list[tuple[str, nn.Module, Policy]]) -> list[tuple[str, nn.Module, Policy, bool, str]]:
    """Apply Policy.max_scope_bytes: (name, module, policy, recurse, block) per scope to build,
    where recurse=False means the module's direct parameters only (its children are scopes too)
    and `block` names the selected module the scope comes from."""
    out: list[tuple[str, nn.Module, Policy, bool, str]] = []

    def visit(name: str, module: nn.Module, policy: Policy, block: str) -> None:
        limit = policy.max_scope_bytes
        children = list(module.named_children())
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
        if limit is None or nbytes <= limit or not children:
            out.append((name, module, policy, True, block))
            return
        out.append((name, module, policy, False, block))
        for child_name, child in children:
            visit(f"{name}.{child_name}" if name else child_name, child, policy, block)

    for name, module, policy in selected:
        visit(name, module, policy, name)
    return out


def _check_selection(model: nn.Module, selected: list[tuple[str, nn.Module, Policy]]) -> None:
    if not selected:
        raise ValueError(
            f"offtensor.wrap: the predicate selected no module of this {type(model).__name__}. "
            "The default selects each element of every nn.ModuleList; pass "
            "predicate=lambda name, module: ... returning True for the blocks to offload "
            f"(top-level children: {[n for n, _ in model.named_children()]})"
        )
    by_module = {id(m): n for n, m, _ in selected}
    for name, module, _ in selected:
        for sub in module.modules():
            if sub is not module and id(sub) in by_module:
                raise ValueError(
                    f"offtensor.wrap: the predicate selected both {name or '<root>'!r} and its "
                    f"submodule {by_module[id(sub)]!r}; a scope includes its submodules, so "
                    "select only one of them"
                )
        for pname, p in module.named_parameters():
            if p.is_meta:
                qual = f"{name}.{pname}" if name else pname
                raise ValueError(
                    f"offtensor.wrap: parameter {qual!r} is on the meta device (no data). Load "
                    "real weights before wrapping: e.g. model.to_empty(device='cpu') and "
                    "load_state_dict(...), or from_pretrained without device_map='meta'"
                )
            if isinstance(p, nn.parameter.UninitializedParameter):
                qual = f"{name}.{pname}" if name else pname
                raise ValueError(f"offtensor.wrap: parameter {qual!r} is uninitialized (lazy module); run one forward first")


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    return offsets, max(total, ALIGN)


def _offload_params(scope: Scope, params: list[tuple[str, nn.Parameter]], device: torch.device) -> None:
    compute_dtype = scope.policy.compute_dtype
    dtypes = [compute_dtype if compute_dtype is not None and p.is_floating_point() else p.dtype
              for _, p in params]
    offsets, scope.nbytes = _layout([p.numel() * p.element_size() for _, p in params])
    dev_offsets, scope.device_nbytes = _layout(
        [p.numel() * dt.itemsize for (_, p), dt in zip(params, dtypes)]
    )
    scope.casts = any(dt != p.dtype for (_, p), dt in zip(params, dtypes))
    by_dtype: dict[torch.dtype, int] = {}
    for _, p in params:
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel() * p.element_size()
    scope.main_dtype = max(by_dtype, key=by_dtype.__getitem__)
    scope.host_flat = host_empty(scope.nbytes, pin=scope.pinned)
    if scope.casts and scope.policy.cast == "host":
        scope.host_shadow = host_empty(scope.device_nbytes, pin=scope.pinned)
    # Allocated here only to create each parameter's device tensor on it; freed below.
    scope.device_flat = torch.empty(scope.device_nbytes, dtype=torch.uint8, device=device)
    storage = scope.device_flat.untyped_storage()
    # Plain tensors that do not require grad: autograd records none of these copies, without
    # grad mode (Note [interrupts]).
    for (qual, p), offset, dev_offset, dt in zip(params, offsets, dev_offsets, dtypes):
        nbytes = p.numel() * p.element_size()
        host = scope.host_flat[offset : offset + nbytes].view(p.dtype).view(p.shape)
        host.copy_(p.detach())
        grad = p.grad
        p.grad = None
        leaf = torch.empty(0, dtype=dt, device=device)
        leaf.set_(storage, dev_offset // dt.itemsize, p.shape, host.stride())
        leaf.__class__ = DeviceCopy
        view = scope.device_flat[dev_offset : dev_offset + p.numel() * dt.itemsize].view(dt).view(p.shape)
        p.data = host
        p.__class__ = OffloadedParameter
        offloaded = cast(OffloadedParameter, p)
        slot = ParamSlot(param=offloaded, name=qual, scope=scope, offset=offset,
                         device_offset=dev_offset, device_leaf=leaf, device_view=view, master=host)
        offloaded._ot = slot
        # The hook stays if the parameter is frozen now and unfrozen later.
        leaf.requires_grad_(True)
        leaf.register_post_accumulate_grad_hook(functools.partial(scope.engine.grads.on_leaf_grad, slot))
        leaf.requires_grad_(p.requires_grad)
        if grad is not None:
            slot.host_grad = host_empty(nbytes, pin=scope.pinned).view(p.dtype).view(p.shape)
            slot.host_grad.copy_(grad.detach())
            p.grad = slot.host_grad
        scope.slots.append(slot)
    storage.resize_(0)
    scope.state = ScopeState.OFFLOADED


def _hook_model_forward(model: nn.Module, engine: TransferEngine) -> None:
    """The model's forward starts the first scope's load (TransferEngine.begin_forward) and,
    if it raises, releases every scope. Not when the model is itself a scope, nor called (a
    ModuleList): then the first scope loads when its own forward starts."""
    if any(scope.module is model for scope in engine.scopes):
        return
    calls = FailureCheck()

    def pre(module: nn.Module, args: tuple) -> None:
        if calls.enter():
            engine.abort()  # an earlier forward was interrupted (KeyboardInterrupt): as if it raised
        engine.begin_forward()

    def post(module: nn.Module, args: tuple, output: object) -> None:
        engine.end_forward(failed=calls.failed())

    engine.handles.append(model.register_forward_pre_hook(Hook(pre)))
    engine.handles.append(model.register_forward_hook(Hook(post), always_call=True))


def _guard_apply(model: nn.Module) -> None:
    for module in model.modules():
        if any(isinstance(p, OffloadedParameter) for p in module._parameters.values()):
            module._apply = functools.partial(_apply_keeping_masters, module)  # type: ignore[method-assign]


def _apply_keeping_masters(module: nn.Module, fn, recurse: bool = True):
    """Module._apply that leaves offloaded masters alone; see Note [moving a wrapped model]."""
    masters = {k: p for k, p in module._parameters.items() if isinstance(p, OffloadedParameter)}
    for p in masters.values():
        try:
            probe = fn(torch.empty(0, dtype=p.dtype))
        except Exception:  # fn does not apply to a CPU probe (e.g. a device that is absent)
            continue
        if isinstance(probe, torch.Tensor) and probe.dtype != p.dtype:
            raise TypeError(
                f"offtensor: cannot convert offloaded parameter {p._ot.name!r} from {p.dtype} "
                f"to {probe.dtype}: the masters of a wrapped model keep their dtype. Convert "
                "before offtensor.wrap(model), or call offtensor.unwrap(model) first. (Device "
                "moves such as model.to('cuda') are fine: they leave the masters on the host.)"
            )
    for key in masters:
        module._parameters[key] = None
    try:
        return type(module)._apply(module, fn, recurse)
    finally:
        for key, p in masters.items():
            module._parameters[key] = p
