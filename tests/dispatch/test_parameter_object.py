"""What an OffloadedParameter is to the code around it.

Outside a scope a parameter behaves like its CPU master: plain tensors come out of it, in-place
writes change the master (and the next forward sees them), and state dicts and optimizer state
hold plain CPU tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_params_match,
    batchnorm_model,
    devices,
    host,
    mlp_of_blocks,
    offload,
    offloaded_parameters,
    random_batch,
    reference_then_offload,
    tolerances,
    train_adamw,
    unwrapped_reference,
)
from torch import nn

import offtensor

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
        assert p.device == torch.device("cpu"), name
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
    assert out.device == torch.device("cpu")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", devices)
def test_grads_of_offloaded_parameters_are_plain_cpu_tensors(device):
    model = offload(mlp_of_blocks(), device)
    x, y = random_batch(device)

    F.mse_loss(model(x), y).backward()

    for name, p in offloaded_parameters(model):
        assert type(p.grad) is torch.Tensor, name
        assert p.grad.device == torch.device("cpu"), name
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
    (x1, y1), (x2, y2) = random_batch(device), random_batch(device)
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


def _no_grad_set(p: torch.Tensor) -> None:
    # Rebinds a plain parameter; an offloaded one copies into its master (torch.nn.utils.parametrize
    # calls this when a right_inverse gives the new original).
    with torch.no_grad():
        p.set_(torch.randn(p.shape))


MUTATIONS = {
    "p.data.normal_": lambda p: p.data.normal_(),
    "p.data.copy_": lambda p: p.data.copy_(torch.randn(p.shape)),
    "no_grad_p.mul_": _no_grad_mul,
    "no_grad_p.set_": _no_grad_set,
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
    # Mutate the reference on the torch.device("cpu") with the same RNG state so both get the same values.
    reference = unwrapped_reference(model, "cpu")
    offload(model, device)
    x, _ = random_batch(device)
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
        assert p.device == torch.device("cpu"), name
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
    x, _ = random_batch(device)

    result = model.load_state_dict(source.state_dict())
    source.to(device)

    assert not result.missing_keys and not result.unexpected_keys
    assert {name: id(p) for name, p in model.named_parameters()} == ids
    for name, p in model.blocks.named_parameters():
        assert isinstance(p, offtensor.OffloadedParameter) and p.device == torch.device("cpu"), name
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
        assert p.device == torch.device("cpu"), name
        assert p.untyped_storage().data_ptr() != state[name].untyped_storage().data_ptr(), name
    assert_params_match(model, source.to(device), rtol=0, atol=0)
    batches = [random_batch(device) for _ in range(3)]
    torch.testing.assert_close(train_adamw(model, batches), train_adamw(reference, batches), **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))


def test_error_if_load_state_dict_would_swap_tensors_loads_nothing():
    """Regression: under set_swap_module_params_on_conversion(True), load_state_dict swapped
    each offloaded parameter's contents for the state dict's tensor: plain parameters that no
    scope loaded, in a model still wrapped, silently."""
    model = offload(mlp_of_blocks(), "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v + 1 for k, v in before.items()}
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match=r"swap offloaded parameter 'blocks\.0\.norm\.weight'.*"
                                               "nothing was loaded"):
            model.load_state_dict(state)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    assert all(isinstance(p, offtensor.OffloadedParameter) for p in model.blocks.parameters())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)


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
            assert value.device == torch.device("cpu"), key
        torch.testing.assert_close(host(value), expected[key], rtol=0, atol=0)


@pytest.mark.parametrize("device", devices)
def test_optimizer_state_of_offloaded_parameters_is_plain_cpu_tensors(device):
    model = offload(mlp_of_blocks(), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = random_batch(device)

    F.mse_loss(model(x), y).backward()
    optimizer.step()

    for name, p in offloaded_parameters(model):
        state = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(state[key]) is torch.Tensor, f"{name}.{key}"
            assert state[key].device == torch.device("cpu"), f"{name}.{key}"
            assert state[key].shape == p.shape, f"{name}.{key}"


