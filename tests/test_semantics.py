"""What an OffloadedParameter is and how a wrapped model behaves to the code around it.

Outside a scope a parameter behaves like its CPU master: plain tensors come out of it,
in-place writes change the master, optimizers and state dicts see plain CPU tensors. Module-level
operations (``to``, ``load_state_dict``, freezing, ``unwrap``) keep working; features such as
BatchNorm statistics, tied weights and partially wrapped models keep their meaning.
"""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import offtensor
from conftest import (
    BlockStack,
    MixedDtypeBlock,
    assert_all_scopes_offloaded,
    assert_backward_matches,
    assert_grads_match,
    assert_params_match,
    batchnorm_model,
    devices,
    host,
    mlp_of_blocks,
    offload,
    offloaded_parameters,
    param_bytes,
    only_blocks,
    reference_then_offload,
    scope_states,
    tied_lm,
    tied_lm_predicate,
    tolerances,
    unwrapped_reference,
)

CPU = torch.device("cpu")


def batch(device: str, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 8).to(device), torch.randn(n, 4).to(device)


def train(model: nn.Module, batches, make_optimizer=None) -> torch.Tensor:
    make_optimizer = make_optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(host(loss))
    return torch.stack(losses)


# --------------------------------------------------------------------------------------------
# The parameter object
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
def test_offloaded_parameter_is_an_nn_parameter_on_cpu(device):
    model = offload(mlp_of_blocks(), device)

    params = dict(offloaded_parameters(model))

    assert set(params) == {name for name, _ in model.blocks.named_parameters(prefix="blocks")}
    for name, p in params.items():
        assert isinstance(p, nn.Parameter), name
        assert isinstance(p, offtensor.OffloadedParameter), name
        assert p.device == CPU, name
        assert p.is_leaf and p.requires_grad, name
        if device == "cuda":
            assert host(p).is_pinned(), f"{name}: master must be pinned when computing on CUDA"
    # Unselected modules keep plain parameters.
    for name, p in [*model.input.named_parameters("input"), *model.head.named_parameters("head")]:
        assert type(p) is nn.Parameter, name


@pytest.mark.parametrize("device", devices)
def test_is_wrapped_reports_wrap_and_unwrap(device):
    model = mlp_of_blocks()
    assert not offtensor.is_wrapped(model)

    offload(model, device)
    assert offtensor.is_wrapped(model)

    offtensor.unwrap(model)
    assert not offtensor.is_wrapped(model)


@pytest.mark.parametrize("device", devices)
def test_repr_of_parameter_says_offloaded_and_compute_device(device):
    model = offload(mlp_of_blocks(), device)

    text = repr(model.blocks[0].fc1.weight)

    assert "offloaded" in text.lower()
    assert device in text


@pytest.mark.parametrize(
    "op",
    [
        pytest.param(torch.zeros_like, id="zeros_like"),
        pytest.param(torch.ones_like, id="ones_like"),
        pytest.param(lambda p: p.detach().clone(), id="detach_clone"),
        pytest.param(lambda p: p.detach() * 2, id="mul"),
    ],
)
@pytest.mark.parametrize("device", devices)
def test_ops_on_parameter_outside_scope_give_plain_cpu_tensors(device, op):
    model = mlp_of_blocks()
    expected = op(model.blocks[0].fc1.weight.detach().clone())
    offload(model, device)

    out = op(model.blocks[0].fc1.weight)

    assert type(out) is torch.Tensor
    assert out.device == CPU
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", devices)
def test_grads_of_offloaded_parameters_are_plain_cpu_tensors(device):
    model = offload(mlp_of_blocks(), device)
    x, y = batch(device)

    F.mse_loss(model(x), y).backward()

    for name, p in offloaded_parameters(model):
        assert type(p.grad) is torch.Tensor, name
        assert p.grad.device == CPU, name
        assert p.grad.shape == p.shape and p.grad.dtype == p.dtype, name
        if device == "cuda":
            assert p.grad.is_pinned(), f"{name}: grad must be pinned when computing on CUDA"
    for name, p in model.head.named_parameters("head"):
        assert p.grad.device.type == device, name


@pytest.mark.parametrize("device", devices)
def test_grad_tensor_held_by_user_is_not_overwritten_after_zero_grad_set_to_none(device):
    # With plain parameters, zero_grad(set_to_none=True) drops p.grad and the next backward
    # makes a new tensor: a grad the user kept (for logging, or to compare micro-batches)
    # keeps its values. Reusing the host grad buffer would silently change it.
    model = offload(mlp_of_blocks(), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (x1, y1), (x2, y2) = batch(device), batch(device)
    F.mse_loss(model(x1), y1).backward()
    kept = {name: p.grad for name, p in offloaded_parameters(model)}
    values = {name: g.clone() for name, g in kept.items()}

    optimizer.zero_grad(set_to_none=True)
    F.mse_loss(model(x2), y2).backward()

    for name, p in offloaded_parameters(model):
        torch.testing.assert_close(kept[name], values[name], rtol=0, atol=0)
        assert not torch.equal(p.grad, values[name]), name


# --------------------------------------------------------------------------------------------
# Writing to masters
# --------------------------------------------------------------------------------------------


def _fan_in_init(p: torch.Tensor) -> None:
    if p.dim() >= 2:
        nn.init.xavier_uniform_(p)
    else:
        nn.init.uniform_(p, -0.5, 0.5)


def _no_grad_mul(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.mul_(1.5)


MUTATIONS = {
    "p.data.normal_": lambda p: p.data.normal_(),
    "p.data.copy_": lambda p: p.data.copy_(torch.randn(p.shape)),
    "no_grad_p.mul_": _no_grad_mul,
    "init.normal_": lambda p: nn.init.normal_(p, std=0.5),
    "init.trunc_normal_": lambda p: nn.init.trunc_normal_(p, std=0.5),
    "init.constant_": lambda p: nn.init.constant_(p, 0.1),
    "init.xavier_uniform_": _fan_in_init,
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("device", devices)
def test_in_place_writes_to_parameter_change_master_and_next_forward(device, mutation):
    mutate = MUTATIONS[mutation]
    model = mlp_of_blocks()
    # Mutate the reference on the CPU with the same RNG state so both get the same values.
    reference = unwrapped_reference(model, "cpu")
    offload(model, device)
    x, _ = batch(device)
    with torch.no_grad():
        before = model(x)  # a first forward: no stale device copy may survive the write

    torch.manual_seed(1)
    for p in reference.blocks.parameters():
        mutate(p)
    reference.to(device)
    torch.manual_seed(1)
    for p in model.blocks.parameters():
        mutate(p)

    with torch.no_grad():
        expected = reference(x)
        out = model(x)
    for name, p in model.blocks.named_parameters():
        assert isinstance(p, offtensor.OffloadedParameter), name
        assert p.device == CPU, name
    assert_params_match(model, reference, rtol=0, atol=0)
    assert not torch.equal(out, before)
    torch.testing.assert_close(out, expected, **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_load_state_dict_into_wrapped_model_updates_masters(device):
    model = mlp_of_blocks()
    torch.manual_seed(123)
    source = mlp_of_blocks()
    offload(model, device)
    ids = {name: id(p) for name, p in model.named_parameters()}
    x, _ = batch(device)

    result = model.load_state_dict(source.state_dict())
    source.to(device)

    assert not result.missing_keys and not result.unexpected_keys
    assert {name: id(p) for name, p in model.named_parameters()} == ids
    for name, p in model.blocks.named_parameters():
        assert isinstance(p, offtensor.OffloadedParameter) and p.device == CPU, name
    assert_params_match(model, source, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(x), source(x), **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_load_state_dict_with_assign_copies_into_the_masters_which_stay_offloaded(device):
    """Regression: assign=True replaced offloaded parameters by plain ones (no scope loaded
    them) while offtensor.is_wrapped still said True."""
    model = batchnorm_model()
    torch.manual_seed(123)
    source = batchnorm_model()
    reference = reference_then_offload(model, device)
    offloaded = dict(offloaded_parameters(model))
    state = {k: v.to(device) if not k.startswith("blocks.") else v for k, v in source.state_dict().items()}

    model.load_state_dict(state, assign=True)
    reference.load_state_dict({k: v.clone().to(device) for k, v in source.state_dict().items()}, assign=True)

    assert dict(offloaded_parameters(model)) == offloaded  # the same objects; the others assigned
    assert model.input.weight is not None and model.input.weight.data_ptr() == state["input.weight"].data_ptr()
    assert offtensor.is_wrapped(model)
    for name, p in offloaded.items():
        assert p.device == CPU, name
        assert p.untyped_storage().data_ptr() != state[name].untyped_storage().data_ptr(), name
    assert_params_match(model, source.to(device), rtol=0, atol=0)
    batches = [batch(device) for _ in range(3)]
    torch.testing.assert_close(train(model, batches), train(reference, batches), **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_error_if_load_state_dict_with_assign_would_change_an_offloaded_dtype(device):
    model = offload(mlp_of_blocks(), device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.half() if k == "blocks.1.fc2.weight" else v.clone() for k, v in before.items()}

    with pytest.raises(TypeError, match=r"'blocks\.1\.fc2\.weight'.*float16.*unwrap"):
        model.load_state_dict(state, assign=True)

    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)  # nothing loaded
    assert all(isinstance(p, offtensor.OffloadedParameter) for p in model.blocks.parameters())


@pytest.mark.parametrize("device", devices)
def test_state_dict_values_are_plain_tensors(device):
    model = mlp_of_blocks()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    offload(model, device)

    state = model.state_dict()

    assert state.keys() == expected.keys()
    for key, value in state.items():
        assert type(value) is torch.Tensor, key
        if key.startswith("blocks."):
            assert value.device == CPU, key
        torch.testing.assert_close(host(value), expected[key], rtol=0, atol=0)


@pytest.mark.parametrize("device", devices)
def test_optimizer_state_of_offloaded_parameters_is_plain_cpu_tensors(device):
    model = offload(mlp_of_blocks(), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch(device)

    F.mse_loss(model(x), y).backward()
    optimizer.step()

    for name, p in offloaded_parameters(model):
        state = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(state[key]) is torch.Tensor, f"{name}.{key}"
            assert state[key].device == CPU, f"{name}.{key}"
            assert state[key].shape == p.shape, f"{name}.{key}"


# --------------------------------------------------------------------------------------------
# unwrap
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
def test_unwrap_restores_plain_parameters_with_same_data_and_grads(device):
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    batches = [batch(device) for _ in range(2)]
    train(reference, batches)
    train(model, batches)
    ids = {name: id(p) for name, p in model.named_parameters()}
    data = {name: host(p).clone() for name, p in model.named_parameters()}
    grads = {name: host(p.grad).clone() for name, p in model.named_parameters()}

    offtensor.unwrap(model)

    assert not offtensor.is_wrapped(model)
    for name, p in model.blocks.named_parameters(prefix="blocks"):
        assert type(p) is nn.Parameter, name
        assert id(p) == ids[name], name
        assert p.device == CPU, name
        assert type(p.grad) is torch.Tensor and p.grad.device == CPU, name
    for name, p in model.named_parameters():
        torch.testing.assert_close(host(p), data[name], rtol=0, atol=0)
        torch.testing.assert_close(host(p.grad), grads[name], rtol=0, atol=0)

    # A plain model again: `.to(device)` moves everything, and it still computes the same.
    model.to(device)
    assert all(p.device.type == device for p in model.parameters())
    x, _ = batch(device)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_wrap_again_after_unwrap_matches_unwrapped_model(device):
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    offtensor.unwrap(model)
    offload(model, device)
    batches = [batch(device) for _ in range(3)]

    expected = train(reference, batches)
    losses = train(model, batches)

    torch.testing.assert_close(losses, expected, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))


# --------------------------------------------------------------------------------------------
# Frozen parameters, buffers, sharing, partial wrapping
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before_wrap", "after_wrap"])
@pytest.mark.parametrize("device", devices)
def test_frozen_parameters_get_no_grad(device, when):
    def freeze(m: nn.Module) -> None:
        m.blocks[0].requires_grad_(False)  # a whole scope
        m.blocks[1].fc1.weight.requires_grad_(False)  # one parameter of a scope

    model = mlp_of_blocks()
    if when == "before_wrap":
        freeze(model)
    reference = reference_then_offload(model, device)
    if when == "after_wrap":
        freeze(model)
        freeze(reference)
    batches = [batch(device) for _ in range(3)]

    expected = train(reference, batches)
    losses = train(model, batches)

    assert model.blocks[0].fc1.weight.grad is None
    assert model.blocks[1].fc1.weight.grad is None
    assert not model.blocks[1].fc1.weight.requires_grad
    assert model.input.weight.grad is not None, "grads must still flow through a frozen scope"
    torch.testing.assert_close(losses, expected, **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_batchnorm_running_stats_update_in_training_like_unwrapped_model(device):
    model = batchnorm_model()
    reference = reference_then_offload(model, device)
    batches = [batch(device, n=8) for _ in range(3)]
    x, _ = batch(device, n=8)

    expected_losses = train(reference, batches)
    reference.eval()
    with torch.no_grad():
        expected = reference(x)
    losses = train(model, batches)
    model.eval()
    with torch.no_grad():
        out = model(x)

    assert int(model.blocks[0].bn.num_batches_tracked) == 3
    assert model.blocks[0].bn.running_mean.device.type == device
    torch.testing.assert_close(losses, expected_losses, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))  # includes the running stats
    torch.testing.assert_close(out, expected, **tolerances(device))


@pytest.mark.parametrize("tied_side", ["head_in_block", "embedding_selected"])
@pytest.mark.parametrize("device", devices)
def test_tied_embedding_and_head_train_like_unwrapped_model(device, tied_side):
    model = tied_lm(tied_side)
    reference = reference_then_offload(model, device, tied_lm_predicate(tied_side))
    tokens = [torch.randint(0, 32, (2, 6)).to(device) for _ in range(3)]

    def run(m: nn.Module) -> torch.Tensor:
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for t in tokens:
            optimizer.zero_grad()
            logits = m(t)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), t[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            losses.append(host(loss))
        return torch.stack(losses)

    expected = run(reference)
    losses = run(model)

    shared = model.embed.weight
    other = model.blocks[-1].proj.weight if tied_side == "head_in_block" else model.head.weight
    assert other is shared, "wrap must keep the two modules sharing one Parameter"
    assert isinstance(shared, offtensor.OffloadedParameter)
    assert len(list(model.parameters())) == len(list(reference.parameters()))
    torch.testing.assert_close(losses, expected, **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_parameter_shared_by_two_scopes_trains_like_unwrapped_model(device):
    model = mlp_of_blocks()
    model.blocks[2].fc1.weight = model.blocks[0].fc1.weight
    reference = reference_then_offload(model, device)
    batches = [batch(device) for _ in range(3)]

    expected = train(reference, batches)
    losses = train(model, batches)

    assert model.blocks[2].fc1.weight is model.blocks[0].fc1.weight
    torch.testing.assert_close(losses, expected, **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_partially_wrapped_model_with_resident_blocks_trains_like_unwrapped_model(device):
    model = mlp_of_blocks(n_blocks=4)
    reference = reference_then_offload(model, device, only_blocks(0, 2))
    batches = [batch(device) for _ in range(3)]

    expected = train(reference, batches)
    losses = train(model, batches)

    assert list(scope_states(model)) == ["blocks.0", "blocks.2"]
    for name, p in model.named_parameters():
        if name.startswith(("blocks.0.", "blocks.2.")):
            assert isinstance(p, offtensor.OffloadedParameter), name
        else:
            assert type(p) is nn.Parameter and p.device.type == device, name
            assert p.grad.device.type == device, name
    torch.testing.assert_close(losses, expected, **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))


# --------------------------------------------------------------------------------------------
# Module-level conversions
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
def test_model_to_device_after_wrap_moves_buffers_and_unselected_params_only(device):
    model = batchnorm_model()
    reference = unwrapped_reference(model, device)
    offtensor.wrap(model, device=device)
    ids = {name: id(p) for name, p in model.named_parameters()}

    assert model.to(device) is model
    model.to("cpu")  # a round trip must not disturb the masters either
    model.to(device)

    assert {name: id(p) for name, p in model.named_parameters()} == ids
    for name, p in model.named_parameters():
        if name.startswith("blocks."):
            assert isinstance(p, offtensor.OffloadedParameter), name
            assert p.device == CPU, name
        else:
            assert p.device.type == device, name
    for name, b in model.named_buffers():
        assert b.device.type == device, name  # buffers inside scopes move too
    x, _ = batch(device, n=8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))


@pytest.mark.parametrize(
    "convert",
    [
        pytest.param(lambda m: m.half(), id="half"),
        pytest.param(lambda m: m.bfloat16(), id="bfloat16"),
        pytest.param(lambda m: m.double(), id="double"),
        pytest.param(lambda m: m.to(torch.float16), id="to_dtype"),
        pytest.param(lambda m: m.to("cpu", torch.float16), id="to_device_and_dtype"),
    ],
)
@pytest.mark.parametrize("device", devices)
def test_dtype_conversion_after_wrap_raises_type_error_naming_the_parameter(device, convert):
    model = offload(mlp_of_blocks(), device, only_blocks(1))

    with pytest.raises(TypeError, match=r"blocks\.1\.(norm|fc1|fc2)\.(weight|bias)"):
        convert(model)


@pytest.mark.parametrize(
    "convert",
    [
        pytest.param(lambda m: m.half(), id="half"),
        pytest.param(lambda m: m.to(torch.bfloat16), id="to_dtype"),
        pytest.param(lambda m: m.to("cpu", torch.float16), id="to_device_and_dtype"),
        pytest.param(lambda m: m.blocks.double(), id="part_of_the_model"),
    ],
)
@pytest.mark.parametrize("device", devices)
def test_a_refused_dtype_conversion_converts_nothing(device, convert):
    """Regression: modules converted before the first one holding a master (here `input` and
    `blocks.0`, and BatchNorm buffers) were left converted, a model of mixed dtypes."""
    model = batchnorm_model().eval()
    reference = reference_then_offload(model, device, only_blocks(1))
    dtypes = {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}

    with pytest.raises(TypeError, match=r"blocks\.1\.(fc|bn)\.(weight|bias).*nothing was converted"):
        convert(model)

    assert {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]} == dtypes
    x, _ = batch(device, n=8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))


@pytest.mark.parametrize(
    "convert",
    [
        pytest.param(lambda m, d: m.float(), id="float"),
        pytest.param(lambda m, d: m.to(d, torch.float32), id="to_device_and_same_dtype"),
        pytest.param(lambda m, d: m.to(torch.float32), id="to_same_dtype"),
    ],
)
@pytest.mark.parametrize("device", devices)
def test_conversions_that_keep_the_dtype_are_fine_after_wrap(device, convert):
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)

    convert(model, device)

    for name, p in offloaded_parameters(model):
        assert p.device == CPU and p.dtype == torch.float32, name
    x, y = batch(device)
    assert_backward_matches(model, model(x), reference, x, y, device)


# --------------------------------------------------------------------------------------------
# Scope lifetime, no_offload, summary
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
def test_scopes_are_offloaded_between_steps(device):
    model = offload(mlp_of_blocks(), device)
    x, y = batch(device)

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
    x, y = batch(device)

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
def test_summary_has_one_row_per_scope(device):
    model = offload(mlp_of_blocks(n_blocks=3), device)

    summary = offtensor.summary(model)

    assert torch.device(summary.device).type == device
    assert [s.name for s in summary.scopes] == ["blocks.0", "blocks.1", "blocks.2"]
    for s, block in zip(summary.scopes, model.blocks):
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
    batches = [batch(device) for _ in range(3)]

    expected = train(reference, batches)
    losses = train(model, batches)

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
    batches = [batch(device) for _ in range(2)]

    expected = train(reference, batches)
    losses = train(model, batches)

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
    x, y = batch(device)
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
    x, y = batch(device)
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
    """Ctrl-C while backward recomputes a checkpointed block. CPU only: on CUDA the autograd
    engine runs the recompute on its own thread, and Python delivers Ctrl-C to the main thread
    only once backward has returned. The recompute's frames are shallower than the forward's."""
    model = mlp_of_blocks()
    model.checkpoint = checkpoint
    reference = unwrapped_reference(model, "cpu")
    handle = _offload_model_or_blocks(model, "cpu", wrapped)
    x, y = batch("cpu")

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
    masters' values, on the CPU, and no offtensor state (Note [copies of a wrapped model])."""
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    x, y = batch(device)
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
    for (name, p), (_, q) in zip(copied.named_parameters(), model.named_parameters()):
        assert type(p) is nn.Parameter, name
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=0, atol=0)
        assert p.untyped_storage().data_ptr() != q.untyped_storage().data_ptr(), name
        if name.startswith("blocks."):
            assert p.device.type == "cpu" and not p.is_pinned(), name
    # The copy computes as a plain model on the CPU, and trains on its own.
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
