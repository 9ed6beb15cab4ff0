"""Every user mistake is reported at the entry point, with the qualified name to fix.

Errors are instructions: each message names the parameter or module concerned and, where
there is one, the remedy. Each test checks the exception type and the key words of the text.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import offtensor
from conftest import devices, mlp_of_blocks, offload, only_blocks, requires_cuda


class NoModuleList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


@pytest.mark.parametrize("device", devices)
def test_error_if_model_on_meta_device(device):
    with torch.device("meta"):
        model = mlp_of_blocks()

    with pytest.raises(ValueError, match="meta") as excinfo:
        offtensor.wrap(model, device=device)

    assert re.search(r"blocks\.0\.\w+\.(weight|bias)", str(excinfo.value))
    assert not offtensor.is_wrapped(model)


@pytest.mark.parametrize("device", devices)
def test_error_if_a_selected_parameter_is_on_meta_device_names_it(device):
    model = mlp_of_blocks()
    with torch.device("meta"):
        model.blocks[1].fc1 = nn.Linear(16, 32)

    with pytest.raises(ValueError, match=r"blocks\.1\.fc1\.weight") as excinfo:
        offtensor.wrap(model, device=device)

    assert "meta" in str(excinfo.value)
    assert not offtensor.is_wrapped(model)
    assert all(type(p) is nn.Parameter for p in model.parameters()), "a failed wrap changes nothing"


@pytest.mark.parametrize("device", devices)
def test_error_if_predicate_selects_nothing(device):
    model = mlp_of_blocks()

    with pytest.raises(ValueError):
        offtensor.wrap(model, lambda name, module: False, device=device)

    assert not offtensor.is_wrapped(model)


@pytest.mark.parametrize("device", devices)
def test_error_if_default_predicate_finds_no_module_list(device):
    model = NoModuleList()

    with pytest.raises(ValueError):
        offtensor.wrap(model, device=device)

    assert not offtensor.is_wrapped(model)


@pytest.mark.parametrize("device", devices)
def test_error_if_selection_is_nested_names_both_modules(device):
    model = mlp_of_blocks()

    def predicate(name: str, module: nn.Module) -> bool:
        return name in ("blocks.0", "blocks.0.fc1")

    with pytest.raises(ValueError, match=r"blocks\.0\.fc1") as excinfo:
        offtensor.wrap(model, predicate, device=device)

    # "blocks.0" on its own, not only as the prefix of "blocks.0.fc1".
    assert re.search(r"blocks\.0(?![.\w])", str(excinfo.value))
    assert not offtensor.is_wrapped(model)
    assert all(type(p) is nn.Parameter for p in model.parameters()), "a failed wrap changes nothing"


@pytest.mark.parametrize("device", devices)
def test_error_if_wrapped_twice_says_to_unwrap_first(device):
    model = offload(mlp_of_blocks(), device)

    with pytest.raises(RuntimeError, match="unwrap"):
        offtensor.wrap(model, device=device)

    assert offtensor.is_wrapped(model)
    assert [s.name for s in offtensor.summary(model).scopes] == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("device", devices)
def test_error_if_a_submodule_of_a_wrapped_model_is_wrapped(device):
    model = offload(mlp_of_blocks(), device, only_blocks(0))

    # model.blocks[0] is already a scope; wrapping the list again would offload it twice.
    with pytest.raises(RuntimeError, match="unwrap"):
        offtensor.wrap(model.blocks, device=device)


@pytest.mark.cuda
@requires_cuda
def test_error_if_input_on_cpu_while_computing_on_cuda_names_scope_and_device():
    model = offload(mlp_of_blocks(), "cuda")
    x = torch.randn(4, 16)  # the hidden state a block expects, but on the CPU

    with pytest.raises(RuntimeError, match=r"blocks\.1") as excinfo:
        model.blocks[1](x)

    assert "cuda" in str(excinfo.value)
    # The failed call leaves nothing behind: the same block works with a correct input.
    out = model.blocks[1](x.cuda())
    assert out.device.type == "cuda"
    assert all(s.device_bytes == 0 for s in offtensor.summary(model).scopes)
