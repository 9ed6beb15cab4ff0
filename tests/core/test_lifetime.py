"""Scope lifetime: offloaded between steps, no_offload, summary, policies, recovery after an
exception or a KeyboardInterrupt, and copies of a wrapped model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import io
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    BlockStack,
    MixedDtypeBlock,
    assert_all_scopes_offloaded,
    assert_backward_matches,
    assert_grads_match,
    assert_params_match,
    copy_of,
    devices,
    mlp_and_reference,
    mlp_of_blocks,
    offload,
    param_bytes,
    random_batch,
    reference_then_offload,
    scope_states,
    tolerances,
    train_adamw,
    unwrapped_reference,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import offtensor
from offtensor.engine.engine import find_engine

# --------------------------------------------------------------------------------------------
# Scope lifetime, no_offload, summary
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
def test_scopes_are_offloaded_between_steps(device):
    model = offload(mlp_of_blocks(), device)
    x, y = random_batch(device)

    assert_all_scopes_offloaded(model)
    with torch.no_grad():
        model(x)
    assert_all_scopes_offloaded(model)
    F.mse_loss(model(x), y).backward()
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_no_offload_keeps_scopes_resident_inside_and_releases_on_exit(device):
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    x, y = random_batch(device)

    F.mse_loss(reference(x), y).backward()
    with offtensor.no_offload():
        out = model(x)
        F.mse_loss(out, y).backward()
        inside = offtensor.summary(model).scopes
    after = offtensor.summary(model).scopes

    for s in inside:
        assert s.state == offtensor.ScopeState.RESIDENT, s.name
        assert s.device_bytes >= param_bytes(model.get_submodule(s.name)), s.name
    for s in after:
        assert s.state == offtensor.ScopeState.OFFLOADED, s.name
        assert s.device_bytes == 0, s.name
    torch.testing.assert_close(out, reference(x), **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_no_offload_of_one_model_leaves_another_wrapped_model_streaming(device):
    held, other = mlp_of_blocks(), mlp_of_blocks()
    ref_held, ref_other = reference_then_offload(held, device), reference_then_offload(other, device)
    x, y = random_batch(device)
    with offtensor.no_offload(held):
        for m in (held, other):
            F.mse_loss(m(x), y).backward()
        held_states = {s.state for s in offtensor.summary(held).scopes}
        other_states = {s.state for s in offtensor.summary(other).scopes}
    assert held_states == {offtensor.ScopeState.RESIDENT}
    assert other_states == {offtensor.ScopeState.OFFLOADED}
    assert_all_scopes_offloaded(held)  # released on exit
    for m, r in ((held, ref_held), (other, ref_other)):
        F.mse_loss(r(x), y).backward()
        assert_grads_match(m, r, **tolerances(device))


def test_no_offload_of_a_model_that_is_not_wrapped_says_so():
    with pytest.raises(ValueError, match=r"offtensor.no_offload: this Sequential is not wrapped"):
        offtensor.no_offload(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize("device", devices)
def test_summary_has_one_row_per_scope(device):
    model = offload(mlp_of_blocks(n_blocks=3), device)

    summary = offtensor.summary(model)

    assert torch.device(summary.device).type == device
    assert [s.name for s in summary.scopes] == ["blocks.0", "blocks.1", "blocks.2"]
    for s, block in zip(summary.scopes, model.blocks, strict=True):
        params = list(block.parameters())
        assert s.state == offtensor.ScopeState.OFFLOADED
        assert s.num_params == sum(p.numel() for p in params)  # elements, not tensors
        # The host buffer may pad each parameter for alignment.
        assert s.host_bytes >= param_bytes(block)
        assert s.device_bytes == 0
    text = str(summary)
    for s in summary.scopes:
        assert s.name in text


POLICIES = [
    pytest.param({}, id="default"),
    pytest.param({"prefetch": 0}, id="prefetch0"),
    pytest.param({"prefetch": 2}, id="prefetch2"),
    pytest.param({"keep_for_backward": True}, id="keep_for_backward"),
    pytest.param({"pin_memory": False}, id="no_pin"),
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("device", devices)
def test_every_policy_trains_like_unwrapped_model(device, policy):
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device, policy=offtensor.Policy(**policy))
    batches = [random_batch(device) for _ in range(3)]

    expected = train_adamw(reference, batches)
    losses = train_adamw(model, batches)

    torch.testing.assert_close(losses, expected, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_predicate_may_return_a_policy_per_scope(device):
    def predicate(name: str, module: nn.Module):
        if name == "blocks.0":
            return offtensor.Policy(prefetch=0)
        return name in ("blocks.1", "blocks.2")

    model = mlp_of_blocks()
    reference = reference_then_offload(model, device, predicate)
    batches = [random_batch(device) for _ in range(2)]

    expected = train_adamw(reference, batches)
    losses = train_adamw(model, batches)

    assert list(scope_states(model)) == ["blocks.0", "blocks.1", "blocks.2"]
    torch.testing.assert_close(losses, expected, **tolerances(device))


def test_policy_is_a_frozen_dataclass_with_documented_defaults():
    policy = offtensor.Policy()

    assert (policy.prefetch, policy.keep_for_backward, policy.pin_memory) == (1, False, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.prefetch = 2  # type: ignore[misc]


@pytest.mark.parametrize("where", ["in_a_scope", "after_the_scopes"])
@pytest.mark.parametrize("grad_enabled", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("device", devices)
def test_exception_in_forward_leaves_scopes_offloaded_and_model_usable(device, grad_enabled, where):
    """After the first step the last scope stays loaded for backward and the first is loaded
    when the model's forward starts: an exception anywhere in the forward must release both."""
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    x, y = random_batch(device)
    F.mse_loss(reference(x), y).backward()
    F.mse_loss(model(x), y).backward()

    def fail(module, inputs, output):
        raise RuntimeError("injected failure")

    failing = model.blocks[1].fc2 if where == "in_a_scope" else model.head
    handle = failing.register_forward_hook(fail)
    with (
        torch.set_grad_enabled(grad_enabled),
        pytest.raises(RuntimeError, match="injected failure"),
    ):
        model(x)
    handle.remove()

    assert_all_scopes_offloaded(model)
    F.mse_loss(reference(x), y).backward()
    out = model(x)
    F.mse_loss(out, y).backward()
    torch.testing.assert_close(out, reference(x), **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
@pytest.mark.parametrize("next_graph", ["retained", "another_forward"])
@pytest.mark.parametrize("device", devices)
def test_a_backward_after_one_that_raised_without_a_forward_between_gives_every_gradient(device, next_graph,
                                                                                         checkpoint):
    """A gradient hook raises in one backward; the next backward runs on a graph made before it
    (a retained one, or a second forward's). Its gradients were lost: the failed backward's
    graph task, never ended, kept every later backward from finishing (Note [a backward that
    raised] in engine/grads.py)."""
    model, reference = mlp_and_reference(device, checkpoint=checkpoint)
    x, y = random_batch(device)
    for m in (reference, model):  # learn the orders
        F.mse_loss(m(x), y).backward()
        m.zero_grad()
    for m in (reference, model):
        first = F.mse_loss(m(x), y)
        second = F.mse_loss(m(2 * x), y) if next_graph == "another_forward" else first

        def fail(grad):
            raise ValueError("user hook failed")

        handle = m.blocks[1].fc1.weight.register_hook(fail)
        with pytest.raises(ValueError, match="user hook failed"):
            first.backward(retain_graph=True)
        handle.remove()
        m.zero_grad()
        second.backward()
    assert_grads_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)


def _interrupt(module, inputs, output):
    raise KeyboardInterrupt


def _deeper(fn, depth: int = 20):
    """Calls fn() from `depth` more Python frames down: the next call after an interrupt may
    come from elsewhere (an evaluate() function) than the interrupted one (a notebook cell)."""
    return fn() if depth == 0 else _deeper(fn, depth - 1)


def _offload_model_or_blocks(model: nn.Module, device: str, wrapped: str) -> nn.Module:
    """Wraps the model, or only its ModuleList (then no model-level hook sees the forward's
    start: the scopes' own hooks must notice an interrupted call). Returns what was wrapped."""
    if wrapped == "model":
        return offload(model, device)
    offtensor.wrap(model.blocks, device=device)
    model.to(device)
    return model.blocks


def _assert_step_matches(model: nn.Module, reference: nn.Module, handle: nn.Module, x, y, device: str) -> None:
    for m in (model, reference):
        m.zero_grad()
    out = model(x)
    F.mse_loss(out, y).backward()
    F.mse_loss(reference(x), y).backward()
    torch.testing.assert_close(out, reference(x), **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(handle)


@pytest.mark.parametrize("next_call", ["same_depth", "deeper"])
@pytest.mark.parametrize("wrapped", ["model", "module_list"])
@pytest.mark.parametrize("where", ["first_scope", "second_scope", "after_the_scopes"])
@pytest.mark.parametrize("grad_enabled", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("device", devices)
def test_keyboard_interrupt_in_forward_is_forgotten_at_the_next_call(device, grad_enabled, where, wrapped,
                                                                     next_call):
    """Ctrl-C runs no `always_call` hook (PyTorch catches only Exception there), so the
    interrupted scope still counts as called. The next call of the model (or, with a wrapped
    ModuleList, of the scope), from wherever it comes, must notice: otherwise an optimizer step
    in between does not release the scope's device copy, and the next forward computes with the
    old weights."""
    model = mlp_of_blocks()
    reference = unwrapped_reference(model, device)
    handle = _offload_model_or_blocks(model, device, wrapped)
    x, y = random_batch(device)
    F.mse_loss(reference(x), y).backward()
    F.mse_loss(model(x), y).backward()

    failing = {"first_scope": model.blocks[0].fc2, "second_scope": model.blocks[1].fc2,
               "after_the_scopes": model.head}[where]
    hook = failing.register_forward_hook(_interrupt)
    with torch.set_grad_enabled(grad_enabled), pytest.raises(KeyboardInterrupt):
        model(x)
    hook.remove()

    # The masters change while the interrupted scope still looks called.
    for m in (model, reference):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    depth = 20 if next_call == "deeper" else 0
    with torch.no_grad():
        torch.testing.assert_close(_deeper(lambda: model(x), depth), reference(x), **tolerances(device))
        model.blocks[0].fc1.weight.sum()  # a use outside the forward: no device copy stays
    assert_all_scopes_offloaded(handle)
    _assert_step_matches(model, reference, handle, x, y, device)


@pytest.mark.parametrize("wrapped", ["model", "module_list"])
@pytest.mark.parametrize("checkpoint", ["reentrant", "non_reentrant"])
def test_keyboard_interrupt_in_a_recompute_in_backward_is_forgotten(checkpoint, wrapped):
    """Ctrl-C while backward recomputes a checkpointed block. torch.device("cpu") only: on CUDA the autograd
    engine runs the recompute on its own thread, and Python delivers Ctrl-C to the main thread
    only once backward has returned. The recompute's frames are shallower than the forward's."""
    model = mlp_of_blocks(checkpoint=checkpoint)
    reference = unwrapped_reference(model, "cpu")
    handle = _offload_model_or_blocks(model, "cpu", wrapped)
    x, y = random_batch("cpu")

    def interrupt_in_backward(module, inputs, output):
        if torch._C._current_graph_task_id() != -1:
            raise KeyboardInterrupt

    for m in (model, reference):
        F.mse_loss(m(x), y).backward()
        hook = m.blocks[0].fc1.register_forward_hook(interrupt_in_backward)
        with pytest.raises(KeyboardInterrupt):
            F.mse_loss(m(x), y).backward()
        hook.remove()
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(0.9)  # the masters change
    _assert_step_matches(model, reference, handle, x, y, "cpu")
    _assert_step_matches(model, reference, handle, x, y, "cpu")


@pytest.mark.parametrize("device", devices)
def test_keyboard_interrupt_caught_inside_no_offload_leaves_no_stale_copy(device):
    """Under no_offload() scopes stay resident, but a write to a master releases its scope's
    copy unless the scope is in use; an interrupted scope looked in use."""
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    x = torch.randn(4, 8, device=device)
    with offtensor.no_offload(), torch.no_grad():
        model(x)
        hook = model.blocks[1].fc2.register_forward_hook(_interrupt)
        with pytest.raises(KeyboardInterrupt):
            model(x)
        hook.remove()
        for m in (model, reference):
            for p in m.parameters():
                p.mul_(0.5)
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("how", ["deepcopy", "torch_save"])
@pytest.mark.parametrize("device", devices)
def test_a_copy_of_a_wrapped_model_is_a_plain_cpu_model_and_the_original_stays_wrapped(device, how):
    """EMA copies and checkpoints of whole models: the copy holds plain parameters with the
    masters' values, on the torch.device("cpu"), and no offtensor state (Note [copies of a wrapped model])."""
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    x, y = random_batch(device)
    F.mse_loss(model(x), y).backward()  # device copies released, grads on the host
    if how == "deepcopy":
        copied = copy.deepcopy(model)
        block = copy.deepcopy(model.blocks[1])  # part of a wrapped model, a scope
        assert not any(isinstance(p, offtensor.OffloadedParameter) for p in block.parameters())
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert not offtensor.is_wrapped(copied)
    for (name, p), (_, q) in zip(copied.named_parameters(), model.named_parameters(), strict=True):
        assert type(p) is nn.Parameter, name
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=0, atol=0)
        assert p.untyped_storage().data_ptr() != q.untyped_storage().data_ptr(), name
        if name.startswith("blocks."):
            assert p.device.type == "cpu" and not p.is_pinned(), name
    # The copy computes as a plain model on the torch.device("cpu"), and trains on its own.
    copied.to("cpu")
    out = copied(x.cpu())
    torch.testing.assert_close(out, reference(x).cpu(), **tolerances(device))
    F.mse_loss(out, y.cpu()).backward()
    torch.optim.SGD(copied.parameters(), lr=0.5).step()
    assert not torch.equal(copied.blocks[0].fc1.weight.detach(), model.blocks[0].fc1.weight.detach().cpu())
    # The original is untouched and still offloads.
    F.mse_loss(reference(x), y).backward()
    model.zero_grad(), reference.zero_grad()
    assert_backward_matches(model, model(x), reference, x, y, device)



@pytest.mark.parametrize("how", ["deepcopy", "torch_save"])
def test_a_copy_of_a_wrapped_model_keeps_the_attributes_of_its_parameters(how):
    """Regression: an offloaded parameter copied (deepcopy) or pickled (torch.save) as a new
    Parameter of its values alone, so the attributes set on it (`p.no_decay = True` for an
    optimizer's param groups), before wrap or after, were gone from the copy, where a plain
    model's torch.save keeps them. They are kept; offtensor's own state (`_ot`) is not."""
    model = mlp_of_blocks()
    model.blocks[1].fc1.weight.no_decay = True  # before wrap
    model.blocks[1].fc1.bias.group = {"lr_scale": 0.5}
    reference = reference_then_offload(model, "cpu")
    model.blocks[2].fc2.weight.lr_scale = 0.1  # after wrap
    expected = {"blocks.1.fc1.weight": {"no_decay": True}, "blocks.1.fc1.bias": {"group": {"lr_scale": 0.5}},
                "blocks.2.fc2.weight": {"lr_scale": 0.1}}
    if how == "torch_save":  # as a plain model pickles them (its deepcopy drops them)
        plain = mlp_of_blocks()
        for name, attributes in expected.items():
            plain.get_parameter(name).__dict__.update(attributes)
        plain = copy_of(plain, how)
        assert {name: vars(plain.get_parameter(name)) for name in expected} == expected
    copied = copy_of(model, how)
    assert not offtensor.is_wrapped(copied)
    for name, p in copied.named_parameters():
        assert type(p) is nn.Parameter, name
        assert vars(p) == expected.get(name, {}), name
    assert copied.blocks[1].fc1.bias.group is not model.blocks[1].fc1.bias.group  # copied with the parameter
    assert model.blocks[1].fc1.weight._ot is not None and model.blocks[1].fc1.weight.no_decay  # the original's stay
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(copied(x), reference(x), rtol=0, atol=0)
    for (name, p), (_, q) in zip(copied.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_a_wrapped_model_whose_scopes_mix_dtypes_saves_and_loads():
    """Regression: a scope's masters were views of one host buffer, and torch.save refuses one
    storage seen with two dtypes (Note [one storage per master])."""
    model = BlockStack([MixedDtypeBlock(), MixedDtypeBlock()], 8, 16, 4)
    reference = reference_then_offload(model, "cpu")
    x = torch.randn(3, 8)
    expected = {k: v.clone() for k, v in reference.state_dict().items()}
    for what in ("state_dict", "model"):
        buffer = io.BytesIO()
        torch.save(model.state_dict() if what == "state_dict" else model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=what == "state_dict")
        state = loaded if what == "state_dict" else loaded.state_dict()
        assert state.keys() == expected.keys()
        for k, v in expected.items():
            assert state[k].dtype == v.dtype, k
            torch.testing.assert_close(state[k], v, rtol=0, atol=0)
    # Loading into the wrapped model writes the masters.
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in expected.items()}
    model.load_state_dict(changed)
    reference.load_state_dict(changed)
    torch.testing.assert_close(model(x), reference(x))
    assert model.blocks[0].fc.weight.dtype == torch.bfloat16 and model.blocks[0].norm.weight.dtype == torch.float32



@pytest.mark.parametrize("device", devices)
def test_backward_and_step_inside_no_offload_trains_like_unwrapped_model(device):
    """Review finding: the worker's steps could not release the device copies that no_offload()
    keeps, and the next forward computed with the weights from before the step."""
    model = mlp_of_blocks(n_blocks=3)
    reference = reference_then_offload(model, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    x = torch.randn(4, 8, device=device)
    with offtensor.no_offload():
        for _ in range(3):
            out = model(x)
            offtensor.backward_and_step(out.square().sum(), opt, zero_grad=True)
            ref_out = reference(x)
            ref_out.square().sum().backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(out, ref_out, **tolerances(device))
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("checkpoint", [None, "reentrant"])
@pytest.mark.parametrize("device", devices)
def test_a_no_grad_forward_in_training_mode_leaves_nothing_on_the_device(device, checkpoint):
    """Found by tests/test_loop_fuzz.py: after a backward, a no-grad forward in training mode
    kept the last scope resident, expecting a backward (as under reentrant checkpointing)."""
    model = mlp_of_blocks(n_blocks=3)
    offload(model, device)
    model.checkpoint = checkpoint
    x = torch.randn(4, 8, device=device)
    for _ in range(2):
        model(x).sum().backward()
        with torch.no_grad():
            model(x)
        assert_all_scopes_offloaded(model)


class _Casts(TorchDispatchMode):
    """Weak references to the bfloat16 casts of matrices made inside it (autocast's casts of
    the weights), by shape."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[tuple[int, ...], weakref.ref]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16 and out.dim() == 2:
            self.made.append((tuple(out.shape), weakref.ref(out)))
        return out

    def alive(self, shapes: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
        gc.collect()
        return [shape for shape, ref in self.made if shape in shapes and ref() is not None]


@pytest.mark.parametrize("how", ["inference", "checkpointed_training"])
def test_autocast_keeps_no_cast_of_a_released_scope_until_it_exits(how):
    """Regression: autocast caches the cast of each leaf that requires grad until the
    outermost autocast region exits; a scope's device copies are such leaves, so a forward
    under autocast kept a reduced-precision copy of every scope on the device after its release
    (measured on an H200: 8 fp32 blocks of 128 MiB, 513 MiB more inside the region, against
    one kept block without the cache)."""
    model = mlp_of_blocks(n_blocks=3, checkpoint="non_reentrant")
    offload(model, "cpu")
    block_shapes = {tuple(p.shape) for p in model.blocks[0].parameters() if p.dim() == 2}
    x = torch.randn(4, 8)
    model(x).sum().backward()  # learn the orders: the last scope is kept for backward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with _Casts() as casts, torch.no_grad() if how == "inference" else contextlib.nullcontext():
            out = model(x)
        alive = casts.alive(block_shapes)
        if how == "inference":
            assert alive == [], "casts of released scopes are still cached"
        else:  # the last scope stays resident for the backward, its casts with it
            assert sorted(alive) == sorted(block_shapes), alive
    if how == "checkpointed_training":
        out.float().sum().backward()
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# A wrapped model that goes out of scope is freed
# --------------------------------------------------------------------------------------------


def _use(model: nn.Module, device: str, how: str) -> None:
    x, y = random_batch(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if how == "inference":
        with torch.no_grad():
            model(x)
    elif how == "training":
        for _ in range(2):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    elif how == "backward_and_step":
        for _ in range(2):
            offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True)
        offtensor.wait_for_steps()
    elif how == "temporary_copies":  # a parameter used outside its scope: a temporary device copy
        w = model.blocks[0].fc1.weight
        (model(x).sum() + F.linear(model.input(x), w).sum()).backward()


def _allocated_by_tensors() -> int:
    """CUDA memory held by tensors: `memory_allocated()` after dropping cuBLAS's workspaces,
    which the caching allocator counts too and which a matmul makes per (thread, stream) pair
    it has not seen: a first backward on a new thread or stream in this process would otherwise
    read as memory the model left behind."""
    torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.memory_allocated()


def _freed_soon(alive, seconds: float = 5.0) -> bool:
    """`alive()` turns False within `seconds`, garbage collected meanwhile. On CUDA, autograd's
    device thread lets go of the graph it ran (whose nodes hold offtensor's hooks, and through
    them the engine) after backward has returned to the caller, so right after `del model` the
    engine may still be referenced for a moment."""
    import gc
    import time

    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        if not alive():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


@pytest.mark.parametrize("how", ["wrapped", "inference", "training", "backward_and_step", "temporary_copies"])
@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
@pytest.mark.parametrize("device", devices)
def test_a_wrapped_model_that_goes_out_of_scope_is_freed(device, checkpoint, how):
    """Regression: each device copy's gradient hook held the engine strongly, through C++
    autograd metadata the garbage collector cannot see into, so a dropped wrapped model was never
    freed, with its pinned masters, gradients and device buffers (Note [hooks that keep a model
    alive]). On CUDA, its device memory comes back too."""
    import gc
    import weakref

    gc.collect()
    before = _allocated_by_tensors() if device == "cuda" else 0
    model = mlp_of_blocks(checkpoint=checkpoint).to(device)
    offtensor.wrap(model, device=device)
    _use(model, device, how)
    engine = weakref.ref(model._offtensor_engine)
    first = weakref.ref(model.blocks[0].fc1.weight)
    del model
    assert _freed_soon(lambda: engine() is not None), "the engine outlived its model"
    assert first() is None, "an offloaded parameter outlived its model"
    if device == "cuda":
        torch.cuda.synchronize()
        assert _allocated_by_tensors() == before, "device memory outlived the model"


@pytest.mark.parametrize("forward", ["eager", "compiled"])
def test_a_scope_call_records_the_frame_of_its_module_call(forward):
    """The record an interrupted call leaves (FailureCheck) holds the frame of the module call,
    found past the hooks' own frames without walking them (Note [the module call's frame] in
    engine/failures.py): a frame that lives exactly as long as the call. One of offtensor's
    would end with the hook, and the next call would forget a call still running; one further
    out (the caller's) would outlive the call, and an interrupted call would stay counted. A
    block whose `forward` is compiled has one more frame of offtensor's on the way."""
    model = mlp_of_blocks()
    offtensor.wrap(model.blocks, device="cpu")
    block = model.blocks[0]
    if forward == "compiled":
        block.forward = torch.compile(block.forward, backend="eager")
    engine = find_engine(model)
    (hooks,) = [h for h in engine.scope_hooks if h.scope.module is block]
    seen = []

    def look(module, args):  # registered after offtensor's pre-hook: runs after it
        (record,) = hooks.calls.records
        frame = record[1]
        on_stack, f = [], sys._getframe()
        while f is not None:
            on_stack.append(f)
            f = f.f_back
        seen.append((frame.f_globals["__name__"], frame.f_locals.get("self") is module,
                     any(f is frame for f in on_stack)))

    block.register_forward_pre_hook(look)
    model(torch.randn(2, 8))
    assert seen == [("torch.nn.modules.module", True, True)]
    assert hooks.calls.records == []
