"""torch.compile of a wrapped model combined with the other features (Note [torch.compile] in
dispatch/compile.py): compressed frozen masters, a VRAM budget, a compute dtype, zero_grad
anywhere, no_offload, backward_and_step with accumulation, exceptions inside compiled code, a
block called twice, tied weights. Each compares against the compiled unwrapped model (or, where
no unwrapped model computes the same thing, the same wrapped model run eagerly), with no
recompile in steady state (`no_recompiles`, `train_both` in test_compile.py)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    BlockStack,
    ResidualBlock,
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    device_layout_bytes,
    devices,
    mlp_of_blocks,
    offload,
    offloaded_parameters,
    reference_then_offload,
)
from test_compile import GraphRecorder, compile_both, mlp_batches, mse, no_recompiles, tolerances, train_both
from torch import nn

import offtensor

dynamo = pytest.importorskip("torch._dynamo")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.config.error_on_recompile = False
    dynamo.reset()


def _warm(i: int) -> contextlib.AbstractContextManager:
    """No recompile after two warm-up steps."""
    return no_recompiles() if i >= 2 else contextlib.nullcontext()


def _step_both(model: nn.Module, reference: nn.Module, opt, ref_opt, tol: dict) -> None:
    assert_grads_match(model, reference, **tol)
    opt.step(), ref_opt.step()
    opt.zero_grad(), ref_opt.zero_grad()


# --------------------------------------------------------------------------------------------
# no_offload(): a held scope's copy goes stale by writes that bypass the parameter
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("write", ["data", "detached"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("device", devices)
def test_writes_bypassing_the_parameter_under_no_offload_reach_the_next_forward(device, compiled, write):
    """Regression: no_offload() holds a streamed scope's device copy from one forward to the
    next, as the VRAM budget keeps a kept scope's; a write through `p.data` or a detached alias
    (PEFT's merge writes `weight.data += delta`) bumps no version the copy was checked against
    for streamed scopes, so the next forward computed with the old weights (eager and compiled
    alike). MasterWrites.outlives_calls treats held scopes as kept ones."""
    model = mlp_of_blocks(n_blocks=3).eval()
    reference = reference_then_offload(model, device)
    if compiled:
        compile_both(model, reference, "model", "aot_eager")
    x = torch.randn(4, 8, device=device)
    with offtensor.no_offload(model), torch.no_grad():
        model(x), reference(x)
        for m in (model, reference):
            w = m.blocks[1].fc1.weight
            (w.data if write == "data" else w.detach()).mul_(2)
            m.blocks[2].fc2.bias.detach().add_(1)
        with no_recompiles() if compiled else contextlib.nullcontext():
            torch.testing.assert_close(model(x), reference(x), **tolerances(device, "aot_eager"))
        assert all(s.state is offtensor.ScopeState.RESIDENT for s in offtensor.summary(model).scopes)
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# Compressed frozen masters, a VRAM budget, a compute dtype
# --------------------------------------------------------------------------------------------


class _LoRALinear(nn.Module):
    """A frozen base linear plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("how", ["model", "blocks"])
@pytest.mark.parametrize("device", devices)
def test_lora_on_a_compressed_base_matches_compiled_model_with_the_same_compressed_values(device, how, fmt):
    """Compiled blocks read the dequantized device copies of the packed masters: training the
    adapters and then inference match the compiled resident model holding the same values."""
    from weights.test_compress import _compressed_reference  # tests/weights/test_compress.py

    model = BlockStack([ResidualBlock(64) for _ in range(3)], 8, 64, 4).requires_grad_(False)
    for block in model.blocks:
        block.fc1, block.fc2 = _LoRALinear(block.fc1), _LoRALinear(block.fc2)
    model.input.requires_grad_(True)
    reference = _compressed_reference(model, fmt, device)
    offload(model, device, policy=offtensor.Policy(frozen_format=fmt, param_filter=offtensor.frozen_only))
    compile_both(model, reference, how, "aot_eager")
    tol = tolerances(device, "aot_eager")
    train_both(model, reference, mlp_batches(device, 4), mse, tol)
    model.eval(), reference.eval()
    for i, (x, _) in enumerate(mlp_batches(device, 3)):
        with torch.no_grad(), no_recompiles() if i >= 1 else contextlib.nullcontext():
            torch.testing.assert_close(model(x), reference(x), **tol)
        assert_all_scopes_offloaded(model)


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("how", ["model", "blocks"])
@pytest.mark.parametrize("device", devices)
def test_a_vram_budget_with_backward_and_step_and_bypassing_writes_matches_compiled_model(device, how):
    """A kept first block with deferred steps (backward_and_step: the worker writes its masters
    after the call returns, and the next compiled forward must read the stepped values), then
    writes through the parameter, `load_state_dict`, `p.data` and a detached alias: each next
    compiled forward reads fresh weights (a stale kept copy would be a silent wrong answer)."""
    model = mlp_of_blocks(n_blocks=6)
    budget = 4 * device_layout_bytes(model.blocks[0])  # streaming (prefetch 1) + 1 kept
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    assert [s.kept for s in offtensor.summary(model).scopes] == [True] + [False] * 5
    compile_both(model, reference, how, "aot_eager")
    tol = tolerances(device, "aot_eager")

    def step(loss: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        offtensor.backward_and_step(loss, opt, zero_grad=True)

    train_both(model, reference, mlp_batches(device), mse, tol, step)
    x = torch.randn(4, 8, device=device)
    with torch.no_grad():
        model(x), reference(x)  # no_grad compiles once more
        scaled = {k: v * 1.5 for k, v in reference.state_dict().items()}
        writes = [
            lambda m: m.blocks[0].fc1.weight.mul_(0.5),
            lambda m: m.load_state_dict(scaled),
            lambda m: m.blocks[0].fc1.weight.data.add_(1.0),
            lambda m: m.blocks[0].norm.bias.detach().add_(1.0),
        ]
        for write in writes:
            write(reference), write(model)
            with no_recompiles():
                torch.testing.assert_close(model(x), reference(x), **tol)
            assert_all_scopes_offloaded(model)


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("how", ["model", "blocks"])
@pytest.mark.parametrize("device", devices)
def test_bf16_compute_over_fp32_masters_compiled_matches_eager(device, how):
    """Policy(compute_dtype=bf16, cast="device"): the compiled blocks get bf16 device copies of
    fp32 masters; losses, fp32 host gradients and steps equal the same wrapped model run eagerly
    (test_training.py checks eager against a reference that casts by hand)."""
    model = mlp_of_blocks(n_blocks=3)
    eager = copy.deepcopy(model)
    policy = offtensor.Policy(compute_dtype=torch.bfloat16, cast="device")
    for m in (model, eager):
        offload(m, device, policy=policy)
        m.input.bfloat16(), m.head.bfloat16()
    if how == "model":
        model.compile(backend="aot_eager")
    else:
        for block in model.blocks:
            block.compile(backend="aot_eager")
    opt, eager_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    tol = tolerances(device, "inductor")  # compiled and eager kernels may differ on CUDA
    for i, (x, y) in enumerate(mlp_batches(device)):
        with _warm(i):
            loss = F.mse_loss(model(x.bfloat16()).float(), y)
            loss.backward()
            eager_loss = F.mse_loss(eager(x.bfloat16()).float(), y)
            eager_loss.backward()
            torch.testing.assert_close(loss, eager_loss, **tol)
            for _, p in offloaded_parameters(model):
                assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
            _step_both(model, eager, opt, eager_opt, tol)
        assert_all_scopes_offloaded(model)
    assert_params_match(model, eager, **tol)


# --------------------------------------------------------------------------------------------
# zero_grad anywhere, no_offload, backward_and_step with accumulation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("device", devices)
def test_zero_grad_between_forward_and_backward_of_compiled_blocks(device, set_to_none):
    """zero_grad after the forward (gradients of the previous micro-batch still there) and a
    second micro-batch accumulated: the host `.grad` equals the compiled reference's."""
    model = mlp_of_blocks(n_blocks=3)
    reference = reference_then_offload(model, device)
    compile_both(model, reference, "blocks", "aot_eager")
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    tol = tolerances(device, "aot_eager")
    for i, (x, y) in enumerate(mlp_batches(device, 4)):
        with _warm(i):
            for m, o in ((model, opt), (reference, ref_opt)):
                F.mse_loss(m(x), y).backward()  # stale gradients zero_grad must clear
                loss = F.mse_loss(m(x * 2), y)
                o.zero_grad(set_to_none=set_to_none)
                loss.backward()
                F.mse_loss(m(x * 3), y).backward()
            assert_grads_match(model, reference, **tol)
            opt.step(), ref_opt.step()
        assert_all_scopes_offloaded(model)
    assert_params_match(model, reference, **tol)


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("device", devices)
def test_backward_and_step_after_accumulated_micro_batches_under_no_offload_compiled(device):
    """Two plain backwards then backward_and_step, inside no_offload(): deferred steps write
    masters whose scopes no_offload holds; each next compiled forward reads the stepped values."""
    model = mlp_of_blocks(n_blocks=3)
    reference = reference_then_offload(model, device)
    compile_both(model, reference, "model", "aot_eager")
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    tol = tolerances(device, "aot_eager")
    batches = [(torch.randn(9, 8, device=device), torch.randn(9, 4, device=device)) for _ in range(4)]
    with offtensor.no_offload(model):
        for i, (x, y) in enumerate(batches):
            with _warm(i):
                for j in range(2):
                    F.mse_loss(model(x[j::3]), y[j::3]).backward()
                    F.mse_loss(reference(x[j::3]), y[j::3]).backward()
                loss, ref_loss = F.mse_loss(model(x[2::3]), y[2::3]), F.mse_loss(reference(x[2::3]), y[2::3])
                offtensor.backward_and_step(loss, opt, zero_grad=True)
                ref_loss.backward()
                ref_opt.step(), ref_opt.zero_grad()
            torch.testing.assert_close(loss, ref_loss, **tol)
    offtensor.wait_for_steps()
    assert_params_match(model, reference, **tol)
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# Exceptions in compiled blocks, a block called twice, tied weights
# --------------------------------------------------------------------------------------------

_RAISE = {"forward": False, "backward": False}


class _MaybeRaise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _RAISE["backward"]:
            raise RuntimeError("raised in backward")
        return grad


@torch.compiler.disable
def _maybe_raise(h: torch.Tensor) -> torch.Tensor:
    if _RAISE["forward"]:
        raise RuntimeError("raised in forward")
    return _MaybeRaise.apply(h)


class _RaisingBlock(ResidualBlock):
    """Raises, on demand, between its two compiled halves: in forward, or in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(_maybe_raise(self.fc1(self.norm(x)))))


@pytest.mark.parametrize("how", ["model", "blocks"])
@pytest.mark.parametrize("device", devices)
def test_compiled_steps_after_exceptions_in_forward_and_backward_stay_exact(device, how):
    model = BlockStack([_RaisingBlock(16) for _ in range(3)], 8, 16, 4)
    reference = reference_then_offload(model, device)
    compile_both(model, reference, how, "aot_eager")
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    tol = tolerances(device, "aot_eager")
    for i, (x, y) in enumerate(mlp_batches(device, 5)):
        for where in ("forward", "backward") if i == 2 else ():
            _RAISE[where] = True
            try:
                for m in (model, reference):
                    with pytest.raises(RuntimeError, match=f"raised in {where}"):
                        F.mse_loss(m(x), y).backward()
            finally:
                _RAISE[where] = False
            opt.zero_grad(), ref_opt.zero_grad()
            assert all(isinstance(p, offtensor.OffloadedParameter) for _, p in offloaded_parameters(model))
        with _warm(i):
            loss, ref_loss = F.mse_loss(model(x), y), F.mse_loss(reference(x), y)
            loss.backward(), ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss, **tol)
            _step_both(model, reference, opt, ref_opt, tol)
        assert_all_scopes_offloaded(model)
    assert_params_match(model, reference, **tol)


class _BlocksCalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([ResidualBlock(16) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.blocks[0](self.blocks[1](h)))  # blocks 1 and 0 again


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("overlap", [False, True], ids=["step", "backward_and_step"])
@pytest.mark.parametrize("how", ["model", "blocks"])
@pytest.mark.parametrize("device", devices)
def test_compiled_blocks_called_twice_per_forward_match(device, how, overlap):
    model = _BlocksCalledTwice()
    reference = reference_then_offload(model, device)
    compile_both(model, reference, how, "aot_eager")

    def step(loss: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        offtensor.backward_and_step(loss, opt, zero_grad=True)

    train_both(model, reference, mlp_batches(device), mse, tolerances(device, "aot_eager"), step if overlap else None)


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([ResidualBlock(16) for _ in range(2)])
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("owner", ["embed", "head"])
@pytest.mark.parametrize("how", ["model", "blocks"])
@pytest.mark.parametrize("device", devices)
def test_tied_embedding_and_head_in_a_scope_match_compiled_model(device, how, owner):
    """The tied weight offloaded in the embedding's scope (the head reads it outside its scope)
    or in the head's (the embedding reads it outside): compiled, training matches and the two
    stay tied."""
    model = _TiedLM()
    reference = reference_then_offload(
        model, device, lambda name, m: name == owner or (name.startswith("blocks.") and name.count(".") == 1))
    compile_both(model, reference, how, "aot_eager")
    batches = [torch.randint(0, 32, (2, 5), device=device) for _ in range(5)]
    train_both(model, reference, batches, lambda m, t: m(t).square().mean(), tolerances(device, "aot_eager"))
    assert model.head.weight is model.embed.weight


# --------------------------------------------------------------------------------------------
# A VRAM budget keeping scopes spread over the model, carrying scopes into the next forward
# --------------------------------------------------------------------------------------------


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("device", devices)
def test_spread_kept_and_carried_scopes_with_accumulation_match_compiled_model(device):
    """Compiled blocks under a budget keeping blocks 0, 4 and 7 (spread) and carrying blocks 1
    and 2 from each backward into the next forward; blocks 1 to 3 frozen, so the carried ones
    outlive the optimizer steps, two micro-batches a step. The compiled blocks must read the
    kept and carried copies (fresh after each step that wrote them) and nothing recompiles:
    a carried scope's copy is the same device buffer as a streamed one's, not a new input."""
    model = mlp_of_blocks(n_blocks=8)
    for i in (1, 2, 3):
        model.blocks[i].requires_grad_(False)
    budget = (2 + 1 + 3) * device_layout_bytes(model.blocks[0])  # streaming (prefetch 1) + 3 kept
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    scopes = offtensor.summary(model).scopes
    assert [i for i, s in enumerate(scopes) if s.kept] == [0, 4, 7]
    compile_both(model, reference, "blocks", "inductor")
    tol = tolerances(device, "inductor")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for i in range(5):
        with _warm(i):
            for _micro in range(2):
                x, y = torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)
                loss, ref_loss = F.mse_loss(model(x), y), F.mse_loss(reference(x), y)
                torch.testing.assert_close(loss, ref_loss, **tol)
                loss.backward()
                ref_loss.backward()
                assert_all_scopes_offloaded(model)
            _step_both(model, reference, opt, ref_opt, tol)
            if i:  # once the order is learned: frozen, so the step did not release them
                assert [s.name for s in offtensor.summary(model).scopes if s.carried] == ["blocks.1", "blocks.2"]
            assert_all_scopes_offloaded(model)
    assert_params_match(model, reference, **tol)
    model.eval(), reference.eval()
    x = torch.randn(4, 8, device=device)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), **tol)
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# A block's forward method compiled, not the block
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", [None,  # the others compile for seconds: the full tier runs them
                                        pytest.param("non_reentrant", marks=pytest.mark.full_tier),
                                        pytest.param("reentrant", marks=pytest.mark.full_tier)])
@pytest.mark.parametrize("device", devices)
def test_compiled_forward_methods_of_blocks_are_one_graph_each_and_train_exactly(device, checkpoint):
    """`block.forward = torch.compile(block.forward, fullgraph=True)`: the hooks run eagerly
    around it (Note [a compiled forward method] in dispatch/compile.py). Regression: they left
    the OffloadedParameters registered, so every op on one broke the graph (the block ran op by
    op, eagerly) and fullgraph=True raised at the first. Now one graph with the device copies,
    shared by the blocks, and training matches the unwrapped model compiled alike, also when
    a checkpoint's recompute calls the compiled forward in backward."""
    model = mlp_of_blocks(n_blocks=3, checkpoint=checkpoint)
    reference = reference_then_offload(model, device)
    recorder = GraphRecorder()
    for m, backend in ((model, recorder), (reference, "aot_eager")):
        for block in m.blocks:
            block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)
    train_both(model, reference, mlp_batches(device, 4), mse, tolerances(device, "aot_eager"))
    graphs = len(recorder.graphs)  # (not the list in the assert: its repr would read released storage)
    assert graphs == (2 if checkpoint == "reentrant" else 1)  # reentrant: forward without grad, recompute with
    masters = {p.untyped_storage().data_ptr() for _, p in offloaded_parameters(model)}
    params = [t for t in recorder.graphs[0][1] if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
    assert len(params) == 6  # norm, fc1 and fc2 weights and biases
    assert [type(t) for t in params] == [nn.Parameter] * 6
    assert not any(t.untyped_storage().data_ptr() in masters for t in params)


@pytest.mark.parametrize("device", devices)
def test_compiled_forward_methods_of_kept_blocks_see_their_copies_as_parameters(device):
    """The same with every block kept (Policy(vram_budget=...)): a kept scope's calls would take
    the steady path (Note [steady calls] in engine/engine.py), which exposes the copies as an
    eager call does; a compiled forward method keeps the compiled path (nn.Parameters in
    `_parameters`), one graph for the blocks, training exactly, nothing left in the modules."""
    model = mlp_of_blocks(n_blocks=3)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(vram_budget=1 << 30))
    recorder = GraphRecorder()
    for m, backend in ((model, recorder), (reference, "aot_eager")):
        for block in m.blocks:
            block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)
    train_both(model, reference, mlp_batches(device, 4), mse, tolerances(device, "aot_eager"))
    assert len(recorder.graphs) == 1
    for graph in recorder.graphs:
        params = [t for t in graph[1] if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
        assert [type(t) for t in params] == [nn.Parameter] * 6
    for block in model.blocks:  # nothing of a call left in the modules' dicts
        assert not any(isinstance(v, torch.Tensor) for m in block.modules() for v in vars(m).values())


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("device", devices)
def test_dynamic_shapes_with_changing_batch_sizes_match_compiled_model(device):
    """`compile(dynamic=True)` under a budget keeping the first block, with backward_and_step:
    each batch size differs, the symbolic graph serves them all (no recompile after the
    first two steps), and the values match the unwrapped model compiled alike."""
    model = mlp_of_blocks(n_blocks=4)
    budget = 4 * device_layout_bytes(model.blocks[0])  # streaming (prefetch 1) + 1 kept
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    for m in (model, reference):
        m.compile(backend="aot_eager", dynamic=True)
    tol = tolerances(device, "aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for i, n in enumerate((3, 5, 7, 2, 9)):
        x, y = torch.randn(n, 8, device=device), torch.randn(n, 4, device=device)
        with _warm(i):
            loss, ref_loss = F.mse_loss(model(x), y), F.mse_loss(reference(x), y)
            offtensor.backward_and_step(loss, opt, zero_grad=True)
            ref_loss.backward()
            ref_opt.step(), ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, **tol)
        assert_all_scopes_offloaded(model)
    offtensor.wait_for_steps()
    assert_params_match(model, reference, **tol)


# --------------------------------------------------------------------------------------------
# a compiled optimizer step writes masters (Note [a compiled optimizer step] in dispatch/optimizer_step.py)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["step", pytest.param("training_step", marks=pytest.mark.full_tier)])  # seconds
@pytest.mark.parametrize("device", devices)
def test_a_compiled_optimizer_step_under_a_vram_budget_leaves_no_stale_kept_copy(device, how):
    """Regression: `torch.compile(opt.step)`, or a compiled function doing forward, backward,
    step and zero_grad, wrote the masters without offtensor's write handling (the graph's
    write-back of its parameter inputs is no op on the parameter): the kept scopes' device
    copies were stale after the step, and on CUDA a prefetch still reading a master was not
    waited for. A step pre-hook treats the masters as an eager step's writes do. Values match
    the unwrapped model stepped eagerly (the compiled AdamW rounds its bias corrections as
    tensors: not bit for bit)."""
    model = mlp_of_blocks(n_blocks=4)
    budget = 4 * device_layout_bytes(model.blocks[0])  # streaming (prefetch 1) + 1 kept
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    assert any(s.kept for s in offtensor.summary(model).scopes)
    tol = tolerances(device, "inductor")  # not bit for bit (above)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    def training_step(m: nn.Module, o: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()

    compiled_step = torch.compile(opt.step, backend="aot_eager")
    compiled_training_step = torch.compile(training_step, backend="aot_eager")
    for x, y in mlp_batches(device, n=3):
        ref_loss = training_step(reference, ref_opt, x, y)
        if how == "step":
            loss = F.mse_loss(model(x), y)
            loss.backward()
            compiled_step()
            opt.zero_grad()
        else:
            loss = compiled_training_step(model, opt, x, y)
        assert_all_scopes_offloaded(model)
        torch.testing.assert_close(loss.detach(), ref_loss, **tol)
        assert_params_match(model, reference, **tol)
