"""Optimizers and gradient kinds beyond the basics train as the unwrapped model does.

Covers sparse gradients (`nn.Embedding(sparse=True)` / `nn.EmbeddingBag(sparse=True)` inside an
offloaded scope, with SparseAdam and SGD, accumulation over micro-batches, `zero_grad` both ways),
the torch.optim optimizers not covered elsewhere (each with `optimizer.step()` and with
`offtensor.backward_and_step`), optimizer state dicts loaded into a fresh optimizer mid-training,
and user gradient hooks on a parameter used inside and outside its scope. Every case compares
against a plain copy of the model made before wrapping, bit for bit on the CPU.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    mlp_of_blocks,
    offload,
    reference_then_offload,
    tied_lm,
    tied_lm_predicate,
    tolerances,
    train_step,
)
from torch import nn

import offtensor

# --------------------------------------------------------------------------------------------
# Sparse gradients
# --------------------------------------------------------------------------------------------


class SparseEmbeddingBlock(nn.Module):
    """Token embeddings with sparse gradients (an Embedding and an EmbeddingBag) and a Linear."""

    def __init__(self, vocab: int = 24, hidden: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, sparse=True)
        self.bag = nn.EmbeddingBag(vocab, hidden, mode="sum", sparse=True)
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embed(tokens) + self.bag(tokens)[:, None, :])


class SparseModel(nn.Module):
    """blocks[0]: sparse embeddings; blocks[1]: a Linear; a plain head. Each block is a scope."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([SparseEmbeddingBlock(), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.blocks[1](self.blocks[0](tokens))))


def _sparse_params(m: SparseModel) -> list[nn.Parameter]:
    return [m.blocks[0].embed.weight, m.blocks[0].bag.weight]


def _dense_params(m: SparseModel) -> list[nn.Parameter]:
    sparse = {id(p) for p in _sparse_params(m)}
    return [p for p in m.parameters() if id(p) not in sparse]


def _tokens(n: int) -> list[torch.Tensor]:
    return [torch.randint(0, 24, (3, 5)) for _ in range(n)]


def _assert_sparse_grads_match(model: nn.Module, reference: nn.Module) -> None:
    """Gradients equal the reference's, sparse where the reference's are."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert p.grad.layout == q.grad.layout, f"{name}: {p.grad.layout}, the reference's {q.grad.layout}"
            torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
@pytest.mark.parametrize("optimizer", ["sparse_adam", "sgd"])
def test_sparse_embedding_gradients_train_like_unwrapped_with_accumulation(optimizer, overlapped, set_to_none):
    """Embedding(sparse=True) and EmbeddingBag(sparse=True) in an offloaded scope: `p.grad` is
    sparse as for a plain parameter, accumulates over micro-batches (onto a zeroed sparse grad
    too), and SparseAdam (with Adam for the dense rest) or SGD train exactly as unwrapped."""
    model = SparseModel()
    reference = reference_then_offload(model, "cpu")
    assert isinstance(model.blocks[0].embed.weight, offtensor.OffloadedParameter)

    def make(m: SparseModel) -> list[torch.optim.Optimizer]:
        if optimizer == "sgd":
            return [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)]
        return [torch.optim.SparseAdam(_sparse_params(m), lr=1e-2), torch.optim.Adam(_dense_params(m), lr=1e-2)]

    opts, ref_opts = make(model), make(reference)
    for _ in range(3):
        batches = _tokens(3)
        for m, optimizers, overlap in ((reference, ref_opts, False), (model, opts, overlapped)):
            for i, tokens in enumerate(batches):
                loss = m(tokens).pow(2).mean() / len(batches)
                if i < len(batches) - 1:
                    loss.backward()
                elif overlap:
                    offtensor.backward_and_step(loss, optimizers[0])
                    for rest in optimizers[1:]:
                        rest.step()
                else:
                    loss.backward()
                    for o in optimizers:
                        o.step()
        offtensor.wait_for_steps()
        _assert_sparse_grads_match(model, reference)
        assert_params_match(model, reference, **tolerances("cpu"))
        for o in ref_opts + opts:
            o.zero_grad(set_to_none=set_to_none)
    assert_all_scopes_offloaded(model)


def test_error_if_a_sparse_gradient_would_be_averaged_by_data_parallel():
    """data_parallel does not average sparse gradients: the gradient path raises, naming the
    parameter, instead of leaving it unaveraged (the reducer stands in for data_parallel's)."""
    from offtensor.engine.engine import find_engine as _find_engine

    model = SparseModel()
    model.blocks[0].fc.requires_grad_(False)  # the first offloaded gradient is a sparse one
    offtensor.wrap(model, lambda name, module: name == "blocks.0", device="cpu")
    _find_engine(model).grads.reducer = object()  # asked nothing before the check
    # Either sparse parameter, whichever the gradient path takes first (Note [gradients on arrival]).
    with pytest.raises(RuntimeError, match=r"offloaded parameter 'blocks\.0\.(bag|embed)\.weight' got a sparse "
                                           r"gradient .* Use sparse=False"):
        model(_tokens(1)[0]).sum().backward()


# --------------------------------------------------------------------------------------------
# Optimizers not covered elsewhere
# --------------------------------------------------------------------------------------------

_O = torch.optim
OPTIMIZERS = {
    "rmsprop_centered": lambda ps: _O.RMSprop(ps, lr=1e-2, centered=True, momentum=0.5, weight_decay=0.1),
    "rmsprop_foreach": lambda ps: _O.RMSprop(ps, lr=1e-2, foreach=True),
    "adamax": lambda ps: _O.Adamax(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamax_foreach": lambda ps: _O.Adamax(ps, lr=1e-2, foreach=True),
    "nadam_decoupled": lambda ps: _O.NAdam(ps, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
    "radam_decoupled_foreach": lambda ps: _O.RAdam(ps, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1,
                                                   foreach=True),
    "asgd": lambda ps: _O.ASGD(ps, lr=1e-2, t0=1, foreach=False),
    "rprop_foreach": lambda ps: _O.Rprop(ps, lr=1e-2, foreach=True),
    "adafactor": lambda ps: _O.Adafactor(ps, lr=1e-2),
    "adadelta": lambda ps: _O.Adadelta(ps, lr=1.0, weight_decay=0.1, foreach=False),
    "sgd_nesterov_maximize": lambda ps: _O.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, maximize=True),
    "sgd_fused": lambda ps: _O.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "adam_amsgrad_maximize": lambda ps: _O.Adam(ps, lr=1e-2, amsgrad=True, maximize=True, foreach=False),
    "adam_amsgrad_fused": lambda ps: _O.Adam(ps, lr=1e-2, amsgrad=True, fused=True),
    "adagrad_fused": lambda ps: _O.Adagrad(ps, lr=1e-2, fused=True),
}


@pytest.mark.every_case
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_optimizers_train_like_unwrapped_with_step_and_backward_and_step(optimizer):
    """Three steps with `optimizer.step()`, then three with backward_and_step; at the fourth a
    fresh optimizer loads the state dict (mid-training, with steps deferred)."""
    model = mlp_of_blocks()
    reference = reference_then_offload(model, "cpu")
    batches = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(6)]
    for m in (reference, model):
        opt = OPTIMIZERS[optimizer](m.parameters())
        for i, (x, y) in enumerate(batches):
            train_step(F.mse_loss(m(x), y), opt, overlap=m is model and i >= 3)
            if i == 3:
                fresh = OPTIMIZERS[optimizer](m.parameters())
                fresh.load_state_dict(opt.state_dict())
                opt = fresh
        offtensor.wait_for_steps()
    assert_params_match(model, reference, **tolerances("cpu"))
    assert_all_scopes_offloaded(model)


class _ClippingAdamW(torch.optim.AdamW):
    """An optimizer of the user's own: clamps every parameter it steps to [-0.05, 0.05]."""

    def step(self, closure=None):
        loss = super().step(closure)
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.clamp_(-0.05, 0.05)
        return loss


@pytest.mark.parametrize("kind", ["torch.optim", "torch.optim, device steps", "own class"])
def test_the_worker_steps_torch_optim_optimizers_without_subclass_dispatch_and_others_with_it(kind, monkeypatch):
    """The worker runs torch.optim's steps with subclass dispatch off (Note [worker steps
    without subclass dispatch]): no `__torch_function__` of an offloaded parameter on its
    thread. An optimizer of another module keeps it. Both train like the unwrapped model (that
    the writes still reach saved graphs: test_kept_graph_used_after_backward_and_step_raises_...
    in test_higher_order.py)."""
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-2)) if kind.startswith("torch.optim") else (
        lambda ps: _ClippingAdamW(ps, lr=1e-2))
    share = 1.0 if kind.endswith("device steps") else 0.0
    monkeypatch.setattr("offtensor.optim.device_steps.DEVICE_MIN_READY", 1)  # the device takes what it can
    model = mlp_of_blocks()
    reference = reference_then_offload(model, "cpu")
    on_worker = []
    original = offtensor.OffloadedParameter.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        if threading.current_thread() is not threading.main_thread():
            on_worker.append(getattr(func, "__name__", func))
        return original(cls, func, types, args, kwargs)

    monkeypatch.setattr(offtensor.OffloadedParameter, "__torch_function__", classmethod(counting))
    opts = [make(m.parameters()) for m in (model, reference)]
    for _ in range(3):
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        report = offtensor.backward_and_step(F.mse_loss(model(x), y), opts[0], zero_grad=True, device_share=share)
        train_step(F.mse_loss(reference(x), y), opts[1], overlap=False)
    offtensor.wait_for_steps()
    assert_params_match(model, reference, **tolerances("cpu"))
    assert (report.device_pieces > 0) == (share > 0)
    if kind.startswith("torch.optim"):
        assert on_worker == []
    else:
        assert "clamp_" in on_worker and "is_complex" in on_worker


class _CountingSGD(torch.optim.SGD):
    """An optimizer of the user's that keeps a step count on itself and decays by it."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=1e-2, momentum=0.9)
        self.t = 0

    def step(self, closure=None):  # type: ignore[override]
        self.t += 1
        loss = super().step(closure)
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.mul_(1 - 1e-3 * self.t)
        return loss


@pytest.mark.parametrize("stepped", ["whole model", "offloaded only"])
def test_an_attribute_the_optimizer_step_sets_on_itself_is_kept_as_after_optimizer_step(stepped):
    """Regression: the worker steps views of the optimizer, and `self.t += 1` in the step set
    `t` on the view, which was dropped: the optimizer's `t` stayed 0 and each step decayed by
    1e-3 instead of t * 1e-3. Every part's step now starts from the attributes as of the call
    and what it sets is written back, so `t` counts steps, not parts, and reads right after the
    call ("offloaded only": no part is stepped on the calling thread)."""
    model = mlp_of_blocks(n_blocks=3)
    reference = reference_then_offload(model, "cpu")

    def optimizers(m):
        if stepped == "whole model":
            return _CountingSGD(m.parameters()), None
        return _CountingSGD(m.blocks.parameters()), torch.optim.SGD([*m.input.parameters(), *m.head.parameters()],
                                                                    lr=1e-2)

    (opt, rest), (ref_opt, ref_rest) = optimizers(model), optimizers(reference)
    for i in range(5):
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        F.mse_loss(reference(x), y).backward()
        for o in (ref_opt, ref_rest):
            if o is not None:
                o.step()
                o.zero_grad()
        if i == 4:  # the worker is slow to step its first piece (hooks run on it, before its step)
            handles = [p.register_post_accumulate_grad_hook(lambda p: time.sleep(0.05))
                       for p in model.blocks.parameters()]
        report = offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True, piece_bytes=1024)
        if rest is not None:
            rest.step()
            rest.zero_grad()
        assert opt.t == ref_opt.t == i + 1
    report.wait()
    for handle in handles:
        handle.remove()
    assert report.pieces > 1 and (report.rest_params == 0) == (stepped == "offloaded only")
    assert_params_match(model, reference, **tolerances("cpu"))
    assert_all_scopes_offloaded(model)


class _NormLoggingSGD(torch.optim.SGD):
    """Records the gradient norm of what it steps on itself: a value of the whole step."""

    def step(self, closure=None):  # type: ignore[override]
        self.grad_norm = torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"]]).norm()
        return super().step(closure)


def test_error_if_the_optimizer_step_sets_an_attribute_to_different_values_in_its_parts():
    """An attribute the step computes from the parameters it steps (a gradient norm) differs
    between the parts backward_and_step steps: raise, naming the class and the attribute,
    rather than keep one part's value."""
    model = offload(mlp_of_blocks(n_blocks=3), "cpu")
    opt = _NormLoggingSGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    with pytest.raises(RuntimeError, match=r"_NormLoggingSGD\.step set its attribute 'grad_norm' to different "
                                           r"values in the parts.*loss\.backward\(\); optimizer\.step\(\)"):
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt)
        offtensor.wait_for_steps()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()  # the plain loop works, and its norm is the whole step's
    grads = [p.grad for p in model.parameters()]
    torch.testing.assert_close(opt.grad_norm, torch.stack([g.norm() for g in grads]).norm(), rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# User gradient hooks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
@pytest.mark.parametrize("tied_side", ["head_in_block", "embedding_selected"])
def test_a_hook_on_a_tied_parameter_sees_the_sum_of_its_uses_once_per_backward(tied_side, overlapped):
    """A tied weight is used inside its scope and outside it (the head or the embedding), so it
    has several device leaves. Regression: each leaf's gradient went through the user's
    `register_hook` hooks on its own, so a non-linear hook (here `sign`) changed the gradient
    and every hook ran once per leaf; a plain parameter's hooks run once, on the sum."""
    model = tied_lm(tied_side)
    reference = reference_then_offload(model, "cpu", tied_lm_predicate(tied_side))
    calls = {id(reference): 0, id(model): 0}
    for m in (reference, model):
        m.embed.weight.register_hook(lambda g: g.sign() * 1e-2)

        def count(g: torch.Tensor, key: int = id(m)) -> None:
            calls[key] += 1

        m.embed.weight.register_hook(count)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
    for _ in range(3):
        micro_batches = [torch.randint(0, 32, (2, 5)) for _ in range(2)]
        for m, o, overlap in ((reference, ref_opt, False), (model, opt, overlapped)):
            m(micro_batches[0]).pow(2).mean().backward()
            train_step(m(micro_batches[1]).pow(2).mean(), o, overlap=overlap)
        offtensor.wait_for_steps()
        assert_params_match(model, reference, **tolerances("cpu"))
    assert calls[id(model)] == calls[id(reference)] == 6
    x = torch.randint(0, 32, (2, 5))
    for m in (reference, model):
        m(x).pow(2).mean().backward()
    assert_grads_match(model, reference, **tolerances("cpu"))
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# Hyperparameters of deferred steps
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["for_loop", "fused"])
def test_a_tensor_lr_changed_in_place_right_after_backward_and_step_applies_from_the_next_step(kind):
    """An LR scheduler writes a tensor lr in place (`group["lr"].fill_()`). Regression: the
    deferred steps of backward_and_step kept the group's lr tensor itself, so a scheduler
    stepped right after the call changed the lr of the steps still running; a float lr
    (replaced, not written) applied from the next step, as after `optimizer.step()`. The
    worker is held until the scheduler has stepped, so that every deferred step runs after it."""
    model = mlp_of_blocks()
    reference = reference_then_offload(model, "cpu")
    options = {"fused": True} if kind == "fused" else {"foreach": False}
    scheduled = threading.Event()

    def hold_the_worker(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if threading.current_thread() is not threading.main_thread():
            assert scheduled.wait(timeout=30), "the scheduler never stepped"

    batches = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(3)]
    for m in (reference, model):
        opt = torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-2), **options)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.1)
        if m is model:
            opt.register_step_pre_hook(hold_the_worker)
        for x, y in batches:
            scheduled.clear()
            train_step(F.mse_loss(m(x), y), opt, overlap=m is model)
            scheduler.step()
            scheduled.set()
            offtensor.wait_for_steps()  # before the next clear()
    assert_params_match(model, reference, **tolerances("cpu"))


@pytest.mark.parametrize("create_graph", [False, True])
def test_autograd_grad_over_an_offloaded_parameter_runs_its_register_hook_hooks(create_graph):
    """`torch.autograd.grad` returns what a leaf's `register_hook` hooks make of its gradient.
    Regression: an offloaded parameter's hooks (kept by offtensor, since the graph holds device
    copies) ran only in backward(), so autograd.grad returned the gradient unhooked."""
    model = mlp_of_blocks()
    reference = reference_then_offload(model, "cpu")
    x = torch.randn(4, 8)
    grads = []
    for m in (reference, model):
        m.blocks[0].fc1.weight.register_hook(lambda g: g.clamp(-1e-2, 1e-2))
        m.blocks[0].fc1.weight.register_hook(lambda g: None)
        params = [m.blocks[0].fc1.weight, m.blocks[1].fc1.weight, m.head.weight]
        grads.append(torch.autograd.grad(m(x).pow(2).sum(), params, create_graph=create_graph))
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected, **tolerances("cpu"))
    assert grads[1][0].abs().max() <= 1e-2
    assert model.blocks[0].fc1.weight.grad is None
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# What backward_and_step cannot step
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replacement", ["torch_compile", "wrapper"])
def test_error_if_backward_and_step_is_given_an_optimizer_whose_step_was_replaced(replacement):
    """Regression: the worker steps views of the optimizer through its class's `step`, so a
    `step` set on the optimizer object was skipped without a word: a wrapper clipping the
    gradients before stepping never clipped, `torch.compile(optimizer.step)` ran eagerly. Now it
    raises before anything changes; an LR scheduler's own wrapper is fine."""
    model = mlp_of_blocks(n_blocks=2)
    reference = reference_then_offload(model, "cpu")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    for o in (opt, ref_opt):
        torch.optim.lr_scheduler.StepLR(o, 1, 0.5)  # its wrapper of `step` comes first
        if replacement == "torch_compile":
            o.step = torch.compile(o.step)
        else:
            def clipped_step(o: torch.optim.Optimizer = o, step=o.step) -> None:
                torch.nn.utils.clip_grad_value_([p for g in o.param_groups for p in g["params"]], 1e-3)
                step()

            o.step = clipped_step
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    what = r"torch\.compile\(optimizer\.step\)" if replacement == "torch_compile" else "a wrapper"
    with pytest.raises(TypeError, match=rf"optimizer\.step was replaced on the SGD object \({what}\), which "
                                        r"backward_and_step would bypass.*SGD\.step itself.*loss\.backward\(\); "
                                        r"optimizer\.step\(\)"):
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt)
    assert all(p.grad is None for p in model.parameters())
    assert_params_match(model, reference, rtol=0, atol=0)
    if replacement == "wrapper":  # the plain loop runs the wrapper
        for m, o in ((model, opt), (reference, ref_opt)):
            F.mse_loss(m(x), y).backward()
            o.step()
        assert_params_match(model, reference, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("stepped", ["whole model", "offloaded only"])
def test_sgd_momentum_steps_like_unwrapped_when_only_some_parameters_have_a_buffer(stepped):
    """torch's foreach SGD picks its momentum kernel by whether every parameter with a gradient
    in the group has a buffer: after a layer is unfrozen some have none, and the group steps per
    tensor, which differs from the foreach kernel in the last bit in bf16. A piece of such a
    group stepped on its own would take the other kernel (Note [groups stepped whole])."""
    torch.manual_seed(0)
    model = mlp_of_blocks(dtype=torch.bfloat16)
    reference = reference_then_offload(model, "cpu")
    batches = [(torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 4, dtype=torch.bfloat16))
               for _ in range(5)]
    for m in (reference, model):
        params = m.parameters() if stepped == "whole model" else [p for b in m.blocks for p in b.parameters()]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)
        m.blocks[1].requires_grad_(False)
        for i, (x, y) in enumerate(batches):
            if i == 2:
                m.blocks[1].requires_grad_(True)  # no momentum buffer yet: the group steps per tensor
            loss = F.mse_loss(m(x).float(), y.float())
            if m is model:
                offtensor.backward_and_step(loss, opt, zero_grad=True, piece_bytes=1)
            else:
                loss.backward()
                opt.step()
                opt.zero_grad()
        offtensor.wait_for_steps()
    assert_params_match(model, reference, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)
