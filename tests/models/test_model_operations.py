"""Module-level operations on a wrapped model: unwrap and wrap again, moves and dtype
conversions after wrap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from conftest import (
    assert_backward_matches,
    assert_trains_like,
    batchnorm_model,
    devices,
    host,
    mlp_of_blocks,
    offload,
    offloaded_parameters,
    only_blocks,
    random_batch,
    reference_then_offload,
    tied_lm,
    tied_lm_predicate,
    tolerances,
    train_adamw,
    unwrapped_reference,
)
from torch import nn

import offtensor

# --------------------------------------------------------------------------------------------
# unwrap
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
def test_unwrap_restores_plain_parameters_with_same_data_and_grads(device):
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    batches = [random_batch(device) for _ in range(2)]
    train_adamw(reference, batches)
    train_adamw(model, batches)
    ids = {name: id(p) for name, p in model.named_parameters()}
    data = {name: host(p).clone() for name, p in model.named_parameters()}
    grads = {name: host(p.grad).clone() for name, p in model.named_parameters()}

    offtensor.unwrap(model)

    assert not offtensor.is_wrapped(model)
    for name, p in model.blocks.named_parameters(prefix="blocks"):
        assert type(p) is nn.Parameter, name
        assert id(p) == ids[name], name
        assert p.device == torch.device("cpu"), name
        assert type(p.grad) is torch.Tensor and p.grad.device == torch.device("cpu"), name
    for name, p in model.named_parameters():
        torch.testing.assert_close(host(p), data[name], rtol=0, atol=0)
        torch.testing.assert_close(host(p.grad), grads[name], rtol=0, atol=0)

    # A plain model again: `.to(device)` moves everything, and it still computes the same.
    model.to(device)
    assert all(p.device.type == device for p in model.parameters())
    x, _ = random_batch(device)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_wrap_again_after_unwrap_matches_unwrapped_model(device):
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    offtensor.unwrap(model)
    offload(model, device)
    assert_trains_like(model, reference, [random_batch(device) for _ in range(3)], device)


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
            assert p.device == torch.device("cpu"), name
        else:
            assert p.device.type == device, name
    for name, b in model.named_buffers():
        assert b.device.type == device, name  # buffers inside scopes move too
    x, _ = random_batch(device, n=8)
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
    x, _ = random_batch(device, n=8)
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
@pytest.mark.parametrize("swapping", [False, True], ids=["set_data", "swap_tensors"])
@pytest.mark.parametrize("device", devices)
def test_conversions_that_keep_the_dtype_are_fine_after_wrap(device, convert, swapping):
    """Also under torch.__future__.set_swap_module_params_on_conversion(True), where
    Module._apply swaps tensors instead of setting `.data`: the masters are hidden from it."""
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)

    with _swapping(swapping):
        convert(model, device)

    for name, p in offloaded_parameters(model):
        assert p.device == torch.device("cpu") and p.dtype == torch.float32, name
    x, y = random_batch(device)
    assert_backward_matches(model, model(x), reference, x, y, device)




@pytest.mark.parametrize("swapping", [False, True], ids=["set_data", "swap_tensors"])
@pytest.mark.parametrize("device", devices)
def test_a_module_given_an_offloaded_parameter_after_wrap_moves_without_converting_it(device, swapping):
    """Regression: a head tied to an offloaded embedding after wrap (transformers'
    tie_weights(), torch.ao's prepare_qat rebuilding a Linear around its weight) holds a master
    that wrap had not guarded: `model.to(...)` converted it like a plain parameter (under
    swapping it raised "Couldn't swap" after moving part of the model; on CUDA it copied the
    master to the device and back, and moved its `.grad` to the device)."""
    model = tied_lm("embedding_selected")
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())  # untied when wrapped
    reference = reference_then_offload(model, device, tied_lm_predicate("embedding_selected"))
    tokens = torch.randint(0, 32, (2, 6)).to(device)
    for m in (reference, model):
        m.head.weight = m.embed.weight
        m(tokens).sum().backward()  # a .grad for the move to meet
    with _swapping(swapping):
        model.to(device)
        model.to("cpu")
        model.to(device)

    assert model.head.weight is model.embed.weight and isinstance(model.head.weight, offtensor.OffloadedParameter)
    assert model.embed.weight.device.type == "cpu" and model.embed.weight.grad.device.type == "cpu"

    def loss(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        return m(t).logsumexp(-1).mean()

    for m in (reference, model):
        m.zero_grad()
    assert_trains_like(model, reference, [tokens] * 3, device, loss_fn=loss)


def _new_parameter(model: nn.Module) -> None:
    model.blocks[1].fc1.weight = nn.Parameter(torch.randn(32, 16))


def _tied_to_a_plain_parameter(model: nn.Module) -> None:
    model.blocks[1].norm.weight = model.input.bias  # as tie_weights() ties a selected head


@pytest.mark.parametrize("replace", [_new_parameter, _tied_to_a_plain_parameter],
                         ids=["new_parameter", "tied_to_a_plain_parameter"])
def test_error_if_an_offloaded_parameter_is_replaced_after_wrap_names_it_and_changes_nothing(replace):
    """Regression: the replacement became a plain parameter of the scope, silently not
    offloaded (on CUDA: resident, or a device-mismatch error of PyTorch's once the input is on
    the device), while the old master stayed in the scope and was still loaded at every call."""
    model = mlp_of_blocks()
    reference = reference_then_offload(model, "cpu")

    with pytest.raises(RuntimeError, match=r"'blocks\.1\.(fc1|norm)\.weight' of scope 'blocks\.1'.*"
                                           r"copy_.*offtensor\.unwrap\(model\)"):
        replace(model)

    assert all(isinstance(p, offtensor.OffloadedParameter) for p in model.blocks.parameters())
    model.blocks[1].fc1.weight = model.blocks[1].fc1.weight  # the same parameter again is fine
    assert_trains_like(model, reference, [random_batch("cpu") for _ in range(2)], "cpu")


@pytest.mark.parametrize("swapping", [False, True], ids=["set_data", "swap_tensors"])
def test_to_empty_leaves_the_masters_offloaded(swapping):
    """`to_empty` (meta-device initialisation) empties the rest of the model; a state dict then
    fills everything, and it trains like the unwrapped model."""
    model = mlp_of_blocks()
    reference = reference_then_offload(model, "cpu")
    with _swapping(swapping):
        model.to_empty(device="cpu")
    assert all(isinstance(p, offtensor.OffloadedParameter) for p in model.blocks.parameters())
    model.load_state_dict(reference.state_dict())
    assert_trains_like(model, reference, [random_batch("cpu") for _ in range(3)], "cpu")


def test_error_if_share_memory_after_wrap_moves_nothing():
    """Regression: `model.share_memory()` left the masters in private memory (the guard hides
    them from conversions) and said nothing: processes forked after it trained copies of their own."""
    model = offload(mlp_of_blocks(), "cpu")
    with pytest.raises(RuntimeError, match=r"'blocks\.0\.norm\.weight' to shared memory.*nothing was moved"):
        model.share_memory()
    assert not any(t.is_shared() for t in [*model.parameters(), *model.buffers()])


@contextlib.contextmanager
def _swapping(on: bool) -> Iterator[None]:
    """torch.__future__.set_swap_module_params_on_conversion(on) inside the block."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(on)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
