"""Every user mistake is reported at the entry point, with the qualified name to fix.

Errors are instructions: each message names the parameter or module concerned and, where
there is one, the remedy. Each test checks the exception type and the key words of the text.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import (
    assert_grads_match,
    devices,
    mlp_of_blocks,
    offload,
    only_blocks,
    requires_cuda,
    unwrapped_reference,
)
from torch import nn

import offtensor


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


def test_error_if_a_model_sharing_a_module_with_a_wrapped_model_is_wrapped_says_to_wrap_them_together():
    a, b = mlp_of_blocks(), mlp_of_blocks()
    b.blocks[1] = a.blocks[1]  # one block shared by two models
    offtensor.wrap(a, device="cpu")

    # Even left out by b's predicate, the shared block's parameters are a's offloaded ones.
    with pytest.raises(RuntimeError, match=r"'blocks\.1\.norm\.weight' is already offloaded .*scope "
                                           r"'blocks\.1'.*sharing.*wrap that"):
        offtensor.wrap(b, lambda name, _: name == "blocks.0", device="cpu")
    assert not hasattr(b, "_offtensor_engine"), "the refused wrap left b wrapped"

    pair = torch.nn.ModuleList([b])
    offtensor.unwrap(a)
    pair.append(a)
    offtensor.wrap(pair, lambda name, _: name.count(".") == 2 and ".blocks." in name, device="cpu")
    assert {s.name for s in offtensor.summary(pair).scopes} == {
        "0.blocks.0", "0.blocks.1", "0.blocks.2", "1.blocks.0", "1.blocks.2"}


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


@pytest.mark.parametrize("device", devices)
def test_error_if_input_on_another_device_on_every_compute_device(device):
    model = offload(mlp_of_blocks(), device)
    x = torch.randn(4, 16, device="meta")  # neither the CPU nor CUDA: wrong for both

    with pytest.raises(RuntimeError, match=r"input tensor 0 of scope 'blocks\.1'.*is on meta"):
        model.blocks[1](x)
    assert model.blocks[1](torch.randn(4, 16, device=device)).device.type == device


@pytest.mark.parametrize("what", [None, torch.zeros(2), "model"])
def test_error_if_wrap_is_given_something_else_than_a_module(what):
    with pytest.raises(TypeError, match=r"offtensor.wrap: expected an nn.Module.*got (NoneType|Tensor|str)"):
        offtensor.wrap(what)


def test_error_if_predicate_is_not_callable():
    with pytest.raises(TypeError, match="predicate must be callable"):
        offtensor.wrap(mlp_of_blocks(), "blocks", device="cpu")


@pytest.mark.parametrize("returned", [torch.tensor(True), "yes", 1])
def test_error_if_predicate_returns_neither_bool_nor_policy_names_the_module(returned):
    model = mlp_of_blocks()
    with pytest.raises(TypeError, match=r"predicate returned (Tensor|str|int) for module '<root>'"):
        offtensor.wrap(model, lambda name, module: returned, device="cpu")
    assert not offtensor.is_wrapped(model)


def test_error_if_param_filter_is_not_callable():
    with pytest.raises(TypeError, match="param_filter must be callable"):
        offtensor.Policy(param_filter="frozen")  # type: ignore[arg-type]


def test_error_if_param_filter_returns_a_non_bool_names_the_parameter():
    policy = offtensor.Policy(param_filter=lambda name, p: p.requires_grad_)  # a method, not a bool
    with pytest.raises(TypeError, match=r"param_filter returned .* for parameter 'blocks\.0\.norm\.weight'"):
        offtensor.wrap(mlp_of_blocks(), device="cpu", policy=policy)


class TiedHead(nn.Module):
    """Embedding, blocks, and a head whose weight is the embedding's (Llama-3.2-1B style)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.lm_head = nn.Linear(16, 32, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


def test_warning_if_a_selected_module_has_only_parameters_tied_to_another_scope():
    """The README's predicate (embedding, layers, lm_head kept for backward) on a tied model:
    lm_head's only parameter belongs to embed_tokens' scope, so lm_head is no scope at all."""

    def select(name, module):
        if name == "lm_head":
            return offtensor.Policy(keep_for_backward=True)
        return name == "embed_tokens" or re.fullmatch(r"layers\.\d+", name) is not None

    model = TiedHead()
    with pytest.warns(UserWarning,
                      match=r"selected 'lm_head'.*tied to parameters of scope 'embed_tokens'.*keep_for_backward"):
        offtensor.wrap(model, select, device="cpu")
    assert [s.name for s in offtensor.summary(model).scopes] == ["embed_tokens", "layers.0", "layers.1"]


def test_error_if_activations_are_not_of_the_compute_dtype_says_to_use_autocast():
    model = mlp_of_blocks()
    offload(model, "cpu", policy=offtensor.Policy(compute_dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"offtensor: .* 'blocks\.0\..*computes in torch.bfloat16.*torch.autocast"):
        model.blocks[0](torch.randn(4, 16))
    assert model.blocks[0](torch.randn(4, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_error_if_autocast_leaves_an_op_of_the_compute_dtype_says_to_cast_its_inputs():
    """CPU autocast does not cast layer_norm's inputs: the advice to use autocast would be
    wrong there, the user already does (a BART or Whisper layer under compute_dtype on the CPU)."""
    model = mlp_of_blocks()
    offload(model, "cpu", policy=offtensor.Policy(compute_dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            RuntimeError, match=r"'blocks\.0\.norm\.weight'.*autocast is on, but it does not cast the "
                                r"inputs of layer_norm on cpu: cast them to torch.bfloat16"):
        model.blocks[0](torch.randn(4, 16))  # fp32 activations, as a model's own fp32 ops give


class Waits(nn.Module):
    """A block whose forward waits until told to go on (to be inside it from another thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.entered = __import__("threading").Event()
        self.go = __import__("threading").Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        self.go.wait(timeout=30)
        return self.fc(x)


class WaitingStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), Waits(), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("second", ["model", "scope"])
def test_error_if_the_same_model_runs_forward_in_two_threads_at_once(second):
    """The second thread is refused before it changes anything: the first thread's forward
    (paused inside its second block) completes with the right result."""
    import threading

    model = WaitingStack()
    reference = WaitingStack()  # events cannot be deep-copied
    reference.load_state_dict(model.state_dict())
    offtensor.wrap(model, device="cpu")
    waits = model.blocks[1]
    x = torch.randn(2, 4)
    results: list[torch.Tensor] = []
    first = threading.Thread(target=lambda: results.append(model(x)))
    first.start()
    assert waits.entered.wait(timeout=30)
    try:
        with pytest.raises(RuntimeError, match="while thread .* is in a forward or backward of the same wrapped model"):
            if second == "model":
                model(x)
            else:
                model.blocks[2](x)
    finally:
        waits.go.set()
        first.join(timeout=30)
    reference.blocks[1].go.set()
    torch.testing.assert_close(results[0], reference(x), rtol=0, atol=0)
    assert all(s.device_bytes == 0 for s in offtensor.summary(model).scopes)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)  # one thread at a time is fine


def test_error_if_a_second_thread_runs_forward_while_the_first_is_in_backward():
    """Review finding: busy counted only forwards; the second thread's forward released the
    first thread's scopes in the middle of its backward."""
    import threading

    model = mlp_of_blocks(n_blocks=3)
    reference = unwrapped_reference(model, "cpu")
    offtensor.wrap(model, device="cpu")
    x = torch.randn(4, 8)
    reference(x).square().sum().backward()
    go, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def other() -> None:
        go.wait(timeout=30)
        try:
            with torch.no_grad():
                model(x)
        except RuntimeError as e:
            errors.append(e)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    h = model.blocks[0](model.input(x))
    h.register_hook(lambda g: (go.set(), done.wait(timeout=30)) and None)  # pause between scopes
    model.head(model.blocks[2](model.blocks[1](h))).square().sum().backward()
    thread.join(timeout=30)
    assert len(errors) == 1 and "is in a forward or backward of the same wrapped model" in str(errors[0])
    assert_grads_match(model, reference, rtol=0, atol=0)


def test_error_if_backward_and_step_is_given_the_loss_as_a_number_and_nothing_is_stepped():
    """Regression: backward_and_step(loss.item(), opt) failed with AttributeError: 'float' object
    has no attribute 'backward'."""
    model = mlp_of_blocks(n_blocks=2)
    reference = unwrapped_reference(model, "cpu")
    offload(model, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(3, 8)).square().mean()
    for number in (loss.item(), 0):
        with pytest.raises(TypeError, match=r"backward_and_step: loss must be the loss tensor, got a (float|int): "
                           r"pass the tensor itself \(not loss\.item\(\) or a float\).*nothing was stepped"):
            offtensor.backward_and_step(number, opt)  # type: ignore[arg-type]
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0, msg=name)
        assert p.grad is None, name
    offtensor.backward_and_step(loss, opt)  # the tensor: steps as before
