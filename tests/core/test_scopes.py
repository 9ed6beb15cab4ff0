"""Scope mechanics: one device copy per scope, recovery after a failed backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (
    BlocksOf,
    BlockStack,
    ResidualBlock,
    assert_all_scopes_offloaded,
    assert_backward_matches,
    assert_grads_match,
    assert_params_match,
    devices,
    mlp_of_blocks,
    offload,
    param_bytes,
    reference_then_offload,
    scope_states,
    small_llama,
    step_both,
    tolerances,
    unwrapped_reference,
)

import offtensor
from offtensor import ScopeState
from offtensor.scopes.scope import Scope


class ReusesItsWeight(nn.Module):
    """Uses the same weight in three ops of one forward."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.fc.weight)
        h = F.linear(torch.tanh(h), self.fc.weight, self.fc.bias)
        return h + self.fc.weight.mean()


@pytest.mark.parametrize("device", devices)
def test_every_op_in_a_scope_sees_the_same_single_device_copy(device, monkeypatch):
    model = BlockStack([ReusesItsWeight(16) for _ in range(3)], 8, 16, 4)
    reference = reference_then_offload(model, device)
    loads, temporaries = [], []
    real_load, real_temp = Scope.load, Scope.temporary_copy
    monkeypatch.setattr(Scope, "load", lambda self, **kw: (
        loads.append(self.name) if self.state is offtensor.ScopeState.OFFLOADED else None,
        real_load(self, **kw))[1])
    monkeypatch.setattr(Scope, "temporary_copy",
                        lambda self, *a: (temporaries.append(a[0].name), real_temp(self, *a))[1])
    seen: dict[str, set[int]] = {}
    from offtensor.dispatch.slot import ParamSlot
    real_use = ParamSlot.use_device_copy

    def spy(slot):
        t = real_use(slot)
        seen.setdefault(slot.name, set()).add(id(t))
        return t

    monkeypatch.setattr(ParamSlot, "use_device_copy", spy)
    x = torch.randn(4, 8, device=device)
    for _ in range(2):
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))
    assert temporaries == [], "ops inside a scope must not make per-op copies"
    assert sorted(loads) == sorted([f"blocks.{i}" for i in range(3)] * 2), loads
    assert all(len(ids) == 1 for ids in seen.values()), seen
    assert seen, "no op saw a device copy"


@pytest.mark.parametrize("device", devices)
def test_model_trains_correctly_after_a_backward_that_raised(device):
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    x, y = torch.randn(6, 8, device=device), torch.randn(6, 4, device=device)

    def explode(grad):
        raise RuntimeError("boom in backward")

    handle = model.blocks[1].register_forward_hook(lambda m, a, out: (out.register_hook(explode), None)[1])
    with pytest.raises(RuntimeError, match="boom in backward"):
        F.mse_loss(model(x), y).backward()
    handle.remove()
    for p in model.parameters():
        p.grad = None

    assert_backward_matches(model, model(x), reference, x, y, device)


@pytest.mark.parametrize("device", devices)
def test_printing_a_released_device_copy_is_safe(device):
    # Regression: after an exception in a forward, pytest printed the arguments of
    # F.layer_norm's frame, among them the device copy of the norm's weight, whose storage had
    # been released: the repr read freed memory and the process died (SIGSEGV on the CPU).
    model = offload(mlp_of_blocks(), device)
    leaf = model.blocks[0].norm.weight._ot.device_leaf
    assert "released" in repr(leaf) and "released" in f"{leaf}"
    seen = []
    hook = model.blocks[0].norm.register_forward_hook(lambda m, a, out: seen.append(repr(m.weight._ot.device_leaf)))
    model(torch.randn(2, 8, device=device))
    hook.remove()
    assert "released" not in seen[0], "while the scope is resident the values print"


class ChecksItsOwnForward(nn.Module):
    """Checkpoints its forward from inside `__call__`, so the module's hooks stay outside the
    checkpointed region and the recompute does not run them (transformers >= 5.2x does this)."""

    def __init__(self, hidden: int, reentrant: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)
        self.reentrant = reentrant

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(torch.tanh(self.norm(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("device", devices)
def test_recompute_outside_the_module_hooks_uses_the_scope_copy_not_per_op_copies(device, reentrant, monkeypatch):
    # Regression: with transformers 5.24 every op of the recompute made its own temporary
    # host-to-device copy (correct, but unprefetched and marking every parameter as used
    # outside its scope, which disabled optimizer overlap).
    model = BlockStack([ChecksItsOwnForward(16, reentrant) for _ in range(3)], 8, 16, 4)
    reference = reference_then_offload(model, device)
    temporaries = []
    real_temp = Scope.temporary_copy
    monkeypatch.setattr(Scope, "temporary_copy",
                        lambda self, *a: (temporaries.append(a[0].name), real_temp(self, *a))[1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        x, y = torch.randn(6, 8, device=device), torch.randn(6, 4, device=device)
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt)
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert temporaries == []
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), **tolerances(device))
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_two_forwards_then_one_backward_matches_unwrapped_model(device):
    # The second forward starts a new pass while the first one's graph still needs every
    # scope in backward: each scope is loaded again for each graph's backward.
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    x1, x2, y = torch.randn(6, 8, device=device), torch.randn(6, 8, device=device), torch.randn(6, 4, device=device)
    (F.mse_loss(model(x1), y) + F.mse_loss(model(x2), y)).backward()
    (F.mse_loss(reference(x1), y) + F.mse_loss(reference(x2), y)).backward()
    assert_grads_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)


# Every scope kept, on any device, by bytes: a timed layout (the default on CUDA) chooses what to
# keep from measured times once it has measured a pass, and may stream a scope that fits; a
# stashed tensor's own backward would read that scope's released copy (docs/design.md, Limits).
KEPT_FROM_THE_START = offtensor.Policy(vram_budget=1 << 30, layout="spread")


class Stashes(nn.Module):
    """Keeps a penalty on its weight outside its outputs, as a weight regularizer may."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.penalty = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.penalty = self.fc.weight.square().sum()
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("kept", [False, True], ids=["streamed", "kept"])
@pytest.mark.parametrize("device", devices)
def test_a_tensor_stashed_outside_a_scopes_outputs_is_exact_in_the_one_backward(device, kept):
    # Design, Limits: a tensor a scope's forward keeps outside its outputs is differentiated
    # exactly when it joins the loss of the one backward: its graph runs inside the scope's
    # backward (what the forward made after the scope's input runs before that input's
    # gradient is whole). In a backward of its own, only a kept scope's copy is still there.
    torch.manual_seed(0)
    model = BlocksOf(Stashes)
    reference = unwrapped_reference(model, device)
    policy = KEPT_FROM_THE_START if kept else offtensor.Policy()
    offtensor.wrap(model, device=device, policy=policy)
    if kept:
        assert all(scope.kept for scope in offtensor.summary(model).scopes)
    for step in range(3):
        x = torch.randn(4, 8, device=device)
        for m in (model, reference):
            out = m(x).square().sum()
            penalties = sum(block.penalty for block in m.blocks)
            if kept and step == 2:
                out.backward()
                penalties.backward()
            else:
                (out + penalties).backward()
        assert_grads_match(model, reference, **tolerances(device))
        model.zero_grad(), reference.zero_grad()
    if not kept:
        assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("then", ["read", "zero_grad", "step", "backward"])
@pytest.mark.parametrize("device", devices)
def test_gradients_of_a_backward_that_ran_no_hook_of_ours_count_before_p_grad_is_used(device, then):
    # A stashed penalty's own backward reaches the device copies of a kept scope without a scope
    # hook (Design, Limits): its gradients must still be in `p.grad` as plain autograd's are,
    # whatever reads them next (an optimizer's step, zero_grad, the next backward).
    torch.manual_seed(0)
    model = BlocksOf(Stashes)
    reference = unwrapped_reference(model, device)
    offtensor.wrap(model, device=device, policy=KEPT_FROM_THE_START)
    assert all(scope.kept for scope in offtensor.summary(model).scopes)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        x = torch.randn(4, 8, device=device)
        for m, o in ((model, opt), (reference, ref_opt)):
            m(x).square().sum().backward()
            sum(block.penalty for block in m.blocks).backward()  # no scope hook runs
            if then == "zero_grad":
                o.zero_grad()  # drops them, as for a plain parameter
                m(x).square().sum().backward()
            elif then == "step":
                o.step()
            elif then == "backward":  # the next backward adds to them
                m(x).sum().backward()
        assert_grads_match(model, reference, **tolerances(device))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("device", devices)
def test_a_block_called_twice_per_forward_matches_unwrapped_model(device, checkpoint):
    shared = mlp_of_blocks(n_blocks=2)
    model = BlockStack([shared.blocks[0], shared.blocks[1], shared.blocks[0]], 8, 16, 4)
    model.checkpoint = checkpoint
    reference = reference_then_offload(model, device)
    assert len(offtensor.summary(model).scopes) == 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        x, y = torch.randn(6, 8, device=device), torch.randn(6, 4, device=device)
        F.mse_loss(model(x), y).backward()
        F.mse_loss(reference(x), y).backward()
        assert_grads_match(model, reference, **tolerances(device))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_all_scopes_offloaded(model)


class Pairing(nn.Module):
    """Takes two inputs and returns its output twice: callers pass it one tensor twice."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tanh(self.fc(a) + b)
        return y, y


class PairingStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Pairing() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.5  # a non-leaf input: its hooks go with its grad_fn
        for block in self.blocks:
            y, z = block(x, x)
            x = y + z
        return x


@pytest.mark.parametrize("kept", [False, True], ids=["streamed", "kept"])
@pytest.mark.parametrize("device", devices)
def test_a_tensor_passed_twice_to_a_scope_ends_its_backward_once_its_gradient_is_whole(device, kept, monkeypatch):
    # Each input and output of a call is hooked once per place it holds (Note [hooks on a
    # call's inputs and outputs] in engine/hooks.py): each scope's backward ends once, when the
    # gradient of its input is whole, in the reverse order of the forward.
    from offtensor.engine import hooks as hooks_module
    from offtensor.engine.hooks import ScopeHooks

    torch.manual_seed(0)
    model = PairingStack()
    policy = offtensor.Policy(vram_budget=1 << 30) if kept else offtensor.Policy()
    reference = unwrapped_reference(model, device)
    offtensor.wrap(model, device=device, policy=policy)
    ended: list[str] = []
    inputs_done, end_kept = ScopeHooks.inputs_done, hooks_module.end_kept_backward

    def ending_kept(engine, scope):  # a kept scope's end (Note [steady backward of a kept scope])
        done = end_kept(engine, scope)
        if done:
            ended.append(scope.name)
        return done

    monkeypatch.setattr(ScopeHooks, "inputs_done", lambda self: (ended.append(self.scope.name), inputs_done(self)))
    monkeypatch.setattr(hooks_module, "end_kept_backward", ending_kept)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    for _ in range(2):
        ended.clear()
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
        assert_grads_match(model, reference, **tolerances(device))
        model.zero_grad(), reference.zero_grad()
        assert ended == ["blocks.2", "blocks.1", "blocks.0"]


def test_hooks_on_a_calls_tensors_run_once_per_place_beside_the_users():
    from offtensor.engine.call_args import on_grad as _on_grad

    calls: list[str] = []
    for leaf in (True, False):  # a leaf, then a tensor with a grad_fn
        x = torch.randn(3, requires_grad=True)
        t = x if leaf else x * 2
        calls.clear()
        mine = t.register_hook(lambda g: calls.append("user, removed"))
        _on_grad(t, lambda g: calls.append("ours"))
        _on_grad(t, lambda g: calls.append("ours"))
        t.register_hook(lambda g: calls.append("user"))
        mine.remove()
        t.sum().backward()
        assert calls == ["ours", "ours", "user"]


def test_two_wrapped_models_in_one_process_keep_separate_scopes():
    a, b = mlp_of_blocks(), mlp_of_blocks()
    ref_a, ref_b = unwrapped_reference(a, "cpu"), unwrapped_reference(b, "cpu")
    offload(a, "cpu")
    offload(b, "cpu")
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    (F.mse_loss(a(x), y) + F.mse_loss(b(a(x)[:, :4].repeat(1, 2)), y)).backward()
    (F.mse_loss(ref_a(x), y) + F.mse_loss(ref_b(ref_a(x)[:, :4].repeat(1, 2)), y)).backward()
    assert_grads_match(a, ref_a, rtol=0, atol=0)
    assert_grads_match(b, ref_b, rtol=0, atol=0)
    assert_all_scopes_offloaded(a)
    assert_all_scopes_offloaded(b)


# --------------------------------------------------------------------------------------------
# Policy(max_scope_bytes=...): large blocks split into one scope per child
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("device", devices)
def test_split_scopes_train_like_unwrapped_model(device, checkpoint):
    model = mlp_of_blocks(n_blocks=3, checkpoint=checkpoint)
    reference = unwrapped_reference(model, device)
    block_bytes = param_bytes(model.blocks[0])
    offload(model, device, policy=offtensor.Policy(max_scope_bytes=block_bytes // 2))
    names = [s.name for s in offtensor.summary(model).scopes]
    assert names == [f"blocks.{i}.{c}" for i in range(3) for c in ("norm", "fc1", "fc2")], names
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(4):
        x, y = torch.randn(6, 8, device=device), torch.randn(6, 4, device=device)
        out, ref_out = model(x), reference(x)
        torch.testing.assert_close(out, ref_out, **tolerances(device))
        F.mse_loss(out, y).backward()
        F.mse_loss(ref_out, y).backward()
        assert_grads_match(model, reference, **tolerances(device))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_all_scopes_offloaded(model)


class OwnParamAndChildren(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(hidden))
        self.fc1 = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x * self.scale)))


@pytest.mark.parametrize("device", devices)
def test_split_keeps_a_modules_own_parameters_in_a_scope_of_their_own(device):
    model = BlockStack([OwnParamAndChildren(16) for _ in range(2)], 8, 16, 4)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(max_scope_bytes=1))
    rows = {s.name: s.num_params for s in offtensor.summary(model).scopes}
    assert rows == {"blocks.0": 16, "blocks.0.fc1": 272, "blocks.0.fc2": 272,
                    "blocks.1": 16, "blocks.1.fc1": 272, "blocks.1.fc2": 272}, rows
    x, y = torch.randn(6, 8, device=device), torch.randn(6, 4, device=device)
    assert_backward_matches(model, model(x), reference, x, y, device)


@pytest.mark.parametrize("device", devices)
def test_hf_llama_split_into_attention_norm_and_mlp_scopes_trains_like_unwrapped(device):
    model = small_llama(checkpointing=True)
    reference = unwrapped_reference(model, device)
    layer_bytes = param_bytes(model.model.layers[0])
    offload(model, device, policy=offtensor.Policy(max_scope_bytes=layer_bytes // 2))
    names = [s.name for s in offtensor.summary(model).scopes]
    assert "model.layers.0.self_attn" in names and "model.layers.0.input_layernorm" in names, names
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 12), device=device)
    for _ in range(3):
        out = model(input_ids=ids, labels=ids)
        ref_out = reference(input_ids=ids, labels=ids)
        torch.testing.assert_close(out.logits, ref_out.logits, **tolerances(device))
        out.loss.backward()
        ref_out.loss.backward()
        assert_grads_match(model, reference, **tolerances(device))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_all_scopes_offloaded(model)


class PartsInLists(nn.Module):
    """A block whose parts sit in ModuleLists, as diffusers' `resnets` and `upsamplers` do."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(2))
        self.upsamplers = nn.ModuleList([nn.Linear(hidden, hidden)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = torch.relu(resnet(x))
        return x + self.upsamplers[0](x)


@pytest.mark.parametrize("device", devices)
def test_split_never_makes_a_scope_of_a_list_whose_forward_never_runs(device):
    """A ModuleList under the limit used to become a scope: never called, it was never loaded,
    and every op on its weights made a temporary copy of its own (a UNet's `upsamplers`). A
    container is split into its elements whatever its size."""
    model = BlockStack([PartsInLists(16) for _ in range(2)], 8, 16, 4)
    block_bytes = param_bytes(model.blocks[0])
    reference = reference_then_offload(model, device, policy=offtensor.Policy(max_scope_bytes=block_bytes // 2))
    names = [s.name for s in offtensor.summary(model).scopes]
    assert names == [f"blocks.{i}.{part}" for i in range(2)
                     for part in ("resnets.0", "resnets.1", "upsamplers.0")], names
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x, y = torch.randn(6, 8, device=device), torch.randn(6, 4, device=device)
    for _ in range(3):
        F.mse_loss(model(x), y).backward()
        F.mse_loss(reference(x), y).backward()
        assert_grads_match(model, reference, **tolerances(device))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert all(s.loads > 0 for s in offtensor.summary(model).scopes), offtensor.summary(model)
    assert_all_scopes_offloaded(model)


def _loads_on_demand(model: nn.Module) -> int:
    return sum(s.loads_on_demand for s in offtensor.summary(model).scopes)


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("split", [False, True], ids=["blocks", "split"])
@pytest.mark.parametrize("wrapped", ["model", "blocks"])
@pytest.mark.parametrize("device", devices)
def test_after_the_first_step_every_load_is_issued_ahead_of_its_use(device, wrapped, split, checkpoint):
    """Prefetch follows the forward order in forward and the learned backward order in backward
    (under checkpointing a split block is recomputed in forward order before its backward), and
    the forward of the wrapped model starts the first scope's load. When what was wrapped is
    not called itself (a ModuleList), the first scope loads when its own forward starts."""
    model = mlp_of_blocks(n_blocks=4, checkpoint=checkpoint)
    block_bytes = param_bytes(model.blocks[0])
    policy = offtensor.Policy(max_scope_bytes=block_bytes // 2 if split else None)
    if wrapped == "model":
        offload(model, device, policy=policy)
        counted = model
    else:
        counted = offtensor.wrap(model.blocks, device=device, policy=policy)
        model.to(device)
    x = torch.randn(6, 8, device=device)
    per_step = []
    for _ in range(3):
        before = _loads_on_demand(counted)
        model(x).sum().backward()
        per_step.append(_loads_on_demand(counted) - before)
    assert per_step[0] > 1  # the first step learns the orders
    expected = 0 if wrapped == "model" else 1
    assert per_step[1:] == [expected, expected], per_step


@pytest.mark.parametrize("device", devices)
def test_the_first_scope_loads_when_the_model_forward_starts(device):
    """What the model computes before its first block hides the first scope's copy."""
    model = mlp_of_blocks(n_blocks=3)
    reference = reference_then_offload(model, device)
    seen = []
    model.input.register_forward_pre_hook(lambda m, a: seen.append(scope_states(model)))
    x = torch.randn(6, 8, device=device)
    for _ in range(3):
        out = model(x)
        out.sum().backward()
        reference(x).sum().backward()
        torch.testing.assert_close(out, reference(x), **tolerances(device))
    assert seen[0]["blocks.0"] is ScopeState.OFFLOADED  # the order is not known yet
    for states in seen[1:]:
        assert states["blocks.0"] is not ScopeState.OFFLOADED, states
        assert all(state is ScopeState.OFFLOADED for name, state in states.items() if name != "blocks.0"), states
    assert_grads_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_hf_llama_split_scopes_are_prefetched_through_the_recompute(device):
    model = small_llama(checkpointing=True)
    layer_bytes = param_bytes(model.model.layers[0])
    offload(model, device, policy=offtensor.Policy(max_scope_bytes=layer_bytes // 2))
    ids = torch.randint(0, 64, (2, 12), device=device)
    per_step = []
    for _ in range(3):
        before = _loads_on_demand(model)
        model(input_ids=ids, labels=ids).loss.backward()
        per_step.append(_loads_on_demand(model) - before)
    assert per_step[1:] == [0, 0], per_step


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_split_scopes_lower_the_inference_peak():
    def peak(policy):
        torch.cuda.empty_cache()
        model = BlockStack([nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
                            for _ in range(6)], 1024, 1024, 8)
        offload(model, "cuda", policy=policy)
        x = torch.randn(4, 1024, device="cuda")
        with torch.no_grad():
            for _ in range(2):  # the second pass prefetches
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                model(x)
                torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    block = (1024 * 4096 * 2 + 4096 + 1024) * 4
    whole = peak(offtensor.Policy())
    split = peak(offtensor.Policy(max_scope_bytes=block // 2))
    assert whole >= 2 * block, whole  # the block computing + the next one in flight
    # One Linear computing + one block's bytes in flight (Policy.prefetch counts blocks).
    assert split <= 1.55 * block, (split, block)


@pytest.mark.parametrize("device", devices)
def test_a_model_called_while_an_exception_is_handled_trains_correctly(device):
    """The usual retry after an out-of-memory error calls the model inside `except`: the
    exception being handled there is not a failure of this forward."""
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    x, y = torch.randn(6, 8, device=device), torch.randn(6, 4, device=device)
    for _ in range(2):  # learn the orders: the last scope is then kept for backward
        F.mse_loss(model(x), y).backward()
        F.mse_loss(reference(x), y).backward()
    try:
        raise RuntimeError("out of memory (pretend)")
    except RuntimeError:
        out = model(x)
        assert_backward_matches(model, out, reference, x, y, device)


class EncoderDecoder(nn.Module):
    """Runs its encoder blocks, or skips them when given cached encoder outputs (how
    encoder-decoder generation calls the model after the first step)."""

    def __init__(self, hidden: int = 16, n: int = 2) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(ResidualBlock(hidden) for _ in range(n))
        self.decoder = nn.ModuleList(ResidualBlock(hidden) for _ in range(n))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.encoder:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor, encoded: torch.Tensor | None = None) -> torch.Tensor:
        h = x + (self.encode(x) if encoded is None else encoded)
        for block in self.decoder:
            h = block(h)
        return h


@pytest.mark.parametrize("device", devices)
def test_decoding_from_cached_encoder_outputs_is_prefetched_and_leaves_nothing_loaded(device):
    """Passes of the model that start at a known scope other than the head of the learned
    order follow the order from there; the model's forward start loads where the last pass
    started; nothing the pass did not use stays loaded, and the order does not grow."""
    model = EncoderDecoder()
    reference = reference_then_offload(model, device)
    engine = model._offtensor_engine
    x = torch.randn(3, 16, device=device)
    learned = ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(x), reference(x), **tolerances(device))
        encoded = model.encode(x)  # outside the model's forward, as generation does
        on_demand = []
        for _ in range(6):  # decoding steps: the encoder does not run
            before = _loads_on_demand(model)
            out = model(x, encoded)
            on_demand.append(_loads_on_demand(model) - before)
            torch.testing.assert_close(out, reference(x, reference.encode(x)), **tolerances(device))
            assert all(state is ScopeState.OFFLOADED for state in scope_states(model).values())
            assert [s.name for s in engine.schedule.order] == learned
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))
    assert on_demand[1:] == [0] * 5, on_demand
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_passes_alternating_between_two_starts_find_their_first_scope_loaded(device):
    """A vision-language model's image and text-only samples, encoder-decoder generation: the
    pass after one that started at the encoder starts at the decoder and the other way round.
    The model's forward start loads where the next pass began after this start last time."""
    model = EncoderDecoder()
    reference = reference_then_offload(model, device)
    x = torch.randn(3, 16, device=device)
    encoded = reference.encode(x).detach()
    on_demand = []
    with torch.no_grad():
        for i in range(8):
            before = _loads_on_demand(model)
            out = model(x) if i % 2 == 0 else model(x, encoded)
            on_demand.append(_loads_on_demand(model) - before)
            expected = reference(x) if i % 2 == 0 else reference(x, encoded)
            torch.testing.assert_close(out, expected, **tolerances(device))
    # The first pass loads everything on demand; the next two learn the two starts' sequence.
    assert on_demand[3:] == [0] * 5, on_demand
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_prefetch_zero_loads_nothing_before_a_scope_needs_it(device):
    model = mlp_of_blocks()
    offload(model, device, policy=offtensor.Policy(prefetch=0))
    seen = []
    model.input.register_forward_pre_hook(lambda m, a: seen.append(scope_states(model)))
    x = torch.randn(6, 8, device=device)
    for _ in range(3):
        model(x).sum().backward()
    for states in seen:
        assert all(state is ScopeState.OFFLOADED for state in states.values()), states


@pytest.mark.parametrize("device", devices)
def test_a_forward_that_uses_no_scope_leaves_nothing_loaded(device):
    """The model's forward start loads a scope ahead of use; a forward that takes another path
    (cached outputs, an early exit) must not leave it on the device."""
    model = EncoderDecoder()
    offload(model, device)
    x = torch.randn(3, 16, device=device)
    with torch.no_grad():
        for _ in range(2):
            model(x)
        model.decoder = nn.ModuleList()  # the same model, now with a path that runs no scope
        model(x, torch.zeros_like(x))
    assert all(state is ScopeState.OFFLOADED for state in scope_states(model).values())


@pytest.mark.parametrize("device", devices)
def test_set_prefetch_replaces_the_learned_order_and_none_restores_it(device):
    """offtensor.set_prefetch, like FSDP2's set_modules_to_forward_prefetch: exactly the listed
    modules load when a module's forward (backward) starts."""
    model = mlp_of_blocks(n_blocks=4)
    reference = reference_then_offload(model, device)
    blocks = model.blocks
    x = torch.randn(6, 8, device=device)

    def on_demand_per_step(steps: int = 2) -> list[int]:
        counts = []
        for _ in range(steps):
            before = _loads_on_demand(model)
            model(x).sum().backward()
            counts.append(_loads_on_demand(model) - before)
        return counts

    assert on_demand_per_step(3)[1:] == [0, 0]  # learned
    for block in blocks:  # nothing ahead: every scope but the preloaded first loads on demand,
        offtensor.set_prefetch(model, block, forward=[], backward=[])  # forward and backward
    assert on_demand_per_step() == [2 * len(blocks) - 2] * 2
    for i, block in enumerate(blocks):  # the whole rest at once, forward and backward
        offtensor.set_prefetch(model, block, forward=list(blocks[i + 1 :]), backward=list(blocks[:i]))
    assert on_demand_per_step() == [0, 0]
    for block in blocks:
        offtensor.set_prefetch(model, block)
    assert on_demand_per_step() == [0, 0]
    model.zero_grad()
    model(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)


def test_set_prefetch_of_a_module_without_offloaded_parameters_names_it():
    model = offload(mlp_of_blocks(n_blocks=2), "cpu")
    with pytest.raises(ValueError, match=r"set_prefetch: module \(Linear, 'input'\) holds no offloaded parameter"):
        offtensor.set_prefetch(model, model.input, forward=[model.blocks[1]])
    with pytest.raises(ValueError, match=r"forward/backward\[0\] \(Linear, not part of the model\)"):
        offtensor.set_prefetch(model, model.blocks[0], forward=[nn.Linear(2, 2)])


class Releasing(nn.Module):
    """Releases another kept scope in its forward, as a write to that scope's master does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.release: Scope | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.release is not None:
            self.release.release(force=True)
        return torch.tanh(self.fc(x))


def test_a_kept_scope_released_during_a_pass_is_prefetched_again(monkeypatch):
    # The forward's prefetch remembers the run of kept, loaded scopes ahead (Note [kept runs] in
    # engine/schedule.py); a scope of the run released since is loaded by the next prefetch, not
    # on demand by its own call.
    torch.manual_seed(0)
    model = BlocksOf(Releasing, 5)
    reference = unwrapped_reference(model, "cpu")
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(vram_budget=1 << 30))
    x = torch.randn(4, 8)
    # Passes through the scopes' hooks: a forward of a model whose scopes are all kept is an
    # exposed pass, which prefetches nothing (Note [exposed passes] in engine/model_hooks.py).
    monkeypatch.setattr("offtensor.engine.model_hooks.ExposedPass.begin", lambda self, args, kwargs: False)
    for _ in range(2):
        model(x)  # the order is learned, every scope kept and loaded
    released = model.blocks[3].fc.weight._ot.scope
    assert released.state is ScopeState.RESIDENT
    before = released.loads_on_demand
    model.blocks[1].release = released  # after the pass's first prefetch remembered blocks 1-4
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert released.loads_on_demand == before and released.state is ScopeState.RESIDENT


@pytest.mark.parametrize("device", devices)
def test_a_backward_that_reaches_no_scope_leaves_no_scope_resident(device):
    """A model that trained its blocks, then froze them and its input layer and trains its head
    only: the scopes' outputs are in no graph, so no backward reaches them, and none stays
    resident for one, the forward's last scope included (it stayed until the next forward,
    though the loop trains). The model trains as the unwrapped one does throughout."""
    model = mlp_of_blocks(3)
    reference = reference_then_offload(model, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        if step == 1:
            for m in (model, reference):
                m.input.requires_grad_(False)
                m.blocks.requires_grad_(False)
        x = torch.randn(5, 8, generator=gen).to(device)
        loss = model(x).square().mean()
        if step:
            assert_all_scopes_offloaded(model)  # after the forward already: no backward will come
        loss.backward()
        reference(x).square().mean().backward()
        assert_all_scopes_offloaded(model)
        step_both(model, reference, opt, ref_opt, {"rtol": 0, "atol": 0})
    assert_params_match(model, reference, rtol=0, atol=0)
