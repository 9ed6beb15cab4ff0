"""torch.compile of a wrapped model (Note [torch.compile] in dispatch/compile.py).

Each test compiles the wrapped model and its unwrapped reference the same way (the whole
model with `model.compile()`, or each selected block with `block.compile()`) and trains both
for several steps: the wrapped model must match the *compiled* unwrapped model. After two
warm-up steps `torch._dynamo.config.error_on_recompile` is set, so any recompile in steady state
fails the test. Most tests use the `aot_eager` backend (AOTAutograd's forward/backward split,
without inductor's compile time); the inductor tests check the same with generated kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ResidualBlock,
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    device_layout_bytes,
    devices,
    host,
    mlp_of_blocks,
    offloaded_parameters,
    reference_then_offload,
    small_llama,
)
from torch import nn

import offtensor
from offtensor.scopes.scope import Scope

dynamo = pytest.importorskip("torch._dynamo")


def tolerances(device: str, backend: str) -> dict[str, float]:
    """Both models run the same compiled kernels on the same values; the optimizer steps the
    masters on the CPU (the reference on the device, on CUDA), and inductor may fuse the
    reference's and the wrapped model's graphs differently at the scope boundaries."""
    if device == "cpu" and backend != "inductor":
        return {"rtol": 0.0, "atol": 0.0}
    return {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    dynamo.reset()
    yield
    dynamo.config.error_on_recompile = False
    dynamo.reset()


@contextlib.contextmanager
def no_recompiles() -> Iterator[None]:
    dynamo.config.error_on_recompile = True
    try:
        yield
    finally:
        dynamo.config.error_on_recompile = False


def compile_both(model: nn.Module, reference: nn.Module, how: str, backend: Any) -> None:
    for m in (model, reference):
        if how == "model":
            m.compile(backend=backend)
        else:
            for block in _blocks(m):
                block.compile(backend=backend)


def _blocks(model: nn.Module) -> list[nn.Module]:
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            return list(m)
    raise AssertionError("no ModuleList")


def train_both(model: nn.Module, reference: nn.Module, batches: list, loss_fn: Callable, tol: dict,
               step: Callable | None = None) -> None:
    """AdamW steps on both models, one per batch, comparing losses, grads and parameters;
    no recompile after the first two steps."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for i, batch in enumerate(batches):
        with no_recompiles() if i >= 2 else contextlib.nullcontext():
            ref_loss = loss_fn(reference, batch)
            ref_loss.backward()
            loss = loss_fn(model, batch)
            if step is None:
                loss.backward()
                assert_grads_match(model, reference, **tol)
                opt.step()
                opt.zero_grad()
            else:
                step(loss, opt)
            ref_opt.step()
            ref_opt.zero_grad()
        torch.testing.assert_close(host(loss), host(ref_loss), **tol)
        assert_all_scopes_offloaded(model)
    offtensor.wait_for_steps()
    assert_params_match(model, reference, **tol)
    assert all(isinstance(p, offtensor.OffloadedParameter) for _, p in offloaded_parameters(model))


def mse(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def mlp_batches(device: str, n: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)) for _ in range(n)]


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


class GraphRecorder:
    """A dynamo backend that records each graph and its example inputs, then runs `backend`."""

    def __init__(self, backend: str = "aot_eager") -> None:
        self.backend = backend
        self.graphs: list[tuple[torch.fx.GraphModule, list]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append((gm, list(example_inputs)))
        return lookup_backend(self.backend)(gm, example_inputs)



# --------------------------------------------------------------------------------------------
# Training and inference match the compiled unwrapped model, without recompiles
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["model", "blocks"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("device", devices)
def test_training_matches_compiled_unwrapped_model(device, backend, how):
    model = mlp_of_blocks(n_blocks=3)
    reference = reference_then_offload(model, device)
    compile_both(model, reference, how, backend)
    train_both(model, reference, mlp_batches(device), mse, tolerances(device, backend))


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("how", ["model", "blocks"])
@pytest.mark.parametrize("device", devices)
def test_inference_matches_compiled_unwrapped_model(device, how):
    model = mlp_of_blocks(n_blocks=3).eval()
    reference = reference_then_offload(model, device)
    compile_both(model, reference, how, "inductor")
    for i, (x, _) in enumerate(mlp_batches(device, 4)):
        with torch.no_grad(), no_recompiles() if i >= 2 else contextlib.nullcontext():
            torch.testing.assert_close(model(x), reference(x), **tolerances(device, "inductor"))
        assert_all_scopes_offloaded(model)


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "hf_checkpointing"])
@pytest.mark.parametrize("how", ["model", "blocks"])
@pytest.mark.parametrize("device", devices)
def test_hf_llama_training_matches_compiled_unwrapped_model(device, how, checkpointing):
    """Also with Hugging Face gradient_checkpointing_enable() (non-reentrant in transformers 5)."""
    model = small_llama(checkpointing=checkpointing)
    reference = reference_then_offload(model, device)
    compile_both(model, reference, how, "aot_eager")
    batches = [torch.randint(0, 64, (2, 8), device=device) for _ in range(4)]
    train_both(model, reference, batches, lm_loss, tolerances(device, "aot_eager"))


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("training", [
    False,
    # Open (2026-12-01, H200): raised cudagraph trees' "accessing tensor output of CUDAGraphs that
    # has been overwritten by a subsequent run" in training; not yet known whether the
    # unwrapped reference, which runs first, raises it too. README lists training under
    # reduce-overhead as untested.
    pytest.param(True, marks=pytest.mark.xfail(reason="cudagraph output overwritten: under investigation")),
], ids=["inference", "training"])
def test_reduce_overhead_blocks_match_the_unwrapped_model_compiled_alike(training):
    """mode="reduce-overhead" records each compiled block as a CUDA graph, which replays with
    the addresses it recorded, while a scope's device copies are allocated anew at each load:
    replaying over freed or reused memory would compute silently wrong values. The device copies
    reach the graph as inputs, not as its module's parameters, so the compiled code copies
    them into the graph's own buffers at each replay, and the results must match the unwrapped
    model compiled alike."""
    model = mlp_of_blocks(n_blocks=3)
    if not training:
        model.eval()
    reference = reference_then_offload(model, "cuda")
    for m in (model, reference):
        for block in _blocks(m):
            block.compile(mode="reduce-overhead")
    tol = tolerances("cuda", "inductor")
    if not training:
        for x, _ in mlp_batches("cuda", 4):
            torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():
                expected = reference(x).clone()
            torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():
                torch.testing.assert_close(model(x).clone(), expected, **tol)
            assert_all_scopes_offloaded(model)
        return
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for batch in mlp_batches("cuda", 5):
        for m in (reference, model):
            torch.compiler.cudagraph_mark_step_begin()
            mse(m, batch).backward()
        assert_grads_match(model, reference, **tol)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        assert_all_scopes_offloaded(model)
    assert_params_match(model, reference, **tol)


def _compiled_mlp_and_reference(device: str, checkpoint: str | None = None) -> tuple[nn.Module, nn.Module]:
    """A 3-block MLP offloaded on `device` and its unwrapped reference, blocks compiled alike
    (aot_eager)."""
    model = mlp_of_blocks(n_blocks=3)
    model.checkpoint = checkpoint
    reference = reference_then_offload(model, device)
    compile_both(model, reference, "blocks", "aot_eager")
    return model, reference


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("checkpoint", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("device", devices)
def test_checkpointed_blocks_match_compiled_unwrapped_model(device, checkpoint):
    model, reference = _compiled_mlp_and_reference(device, checkpoint)
    train_both(model, reference, mlp_batches(device), mse, tolerances(device, "aot_eager"))


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("device", devices)
def test_backward_and_step_matches_compiled_unwrapped_model(device):
    model, reference = _compiled_mlp_and_reference(device)

    def step(loss: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        offtensor.backward_and_step(loss, opt, zero_grad=True)

    train_both(model, reference, mlp_batches(device), mse, tolerances(device, "aot_eager"), step)


@pytest.mark.parametrize("overlap", [pytest.param(False, id="step", marks=pytest.mark.full_tier),  # compiles: seconds
                                     pytest.param(True, id="backward_and_step")])
def test_a_compiled_training_step_function_trains_like_the_unwrapped_one(overlap):
    """torch.compile around the whole training step: forward, loss, backward and the optimizer.
    Regression: with `backward_and_step` in it, dynamo went on through backward_and_step into
    backward, compiled the gradient hooks' frames and failed tracing a host copy of a gradient;
    backward_and_step now runs outside dynamo, its optimizer steps eagerly (so the reference's
    step does too: a compiled AdamW rounds differently)."""
    model = mlp_of_blocks(n_blocks=2)
    reference = reference_then_offload(model, "cpu")
    batches = mlp_batches("cpu", 3)
    losses = []
    for m, how in ((reference, "eager_step" if overlap else "in_graph"),
                   (model, "backward_and_step" if overlap else "in_graph")):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

        @torch.compile(backend="aot_eager")
        def train_step(x: torch.Tensor, y: torch.Tensor, m: nn.Module = m, opt: torch.optim.Optimizer = opt,
                       how: str = how) -> torch.Tensor:
            loss = F.mse_loss(m(x), y)
            if how == "backward_and_step":
                offtensor.backward_and_step(loss, opt, zero_grad=True)
            elif how == "in_graph":
                loss.backward()
                opt.step()
                opt.zero_grad()
            return loss

        step_losses = []
        for x, y in batches:
            loss = train_step(x, y)
            if how == "eager_step":
                loss.backward()
                opt.step()
                opt.zero_grad()
            step_losses.append(loss.detach())
        losses.append(torch.stack(step_losses))
    offtensor.wait_for_steps()
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    assert_params_match(model, reference, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


def test_the_optimizer_worker_never_steps_while_dynamo_compiles_on_another_thread():
    """Note [compiling beside the optimizer worker]: `torch.compiler.is_compiling()` is one flag
    for the process, set while dynamo compiles on any thread. The worker's deferred steps ran
    while the next (compiled) forward compiled, and torch.optim took the compiler's paths on
    real tensors: AdamW's bias corrections as float32 tensors, an ulp away from optimizer.step()
    (a compiled training step with backward_and_step failed about one run in seven). A thread
    standing in for dynamo holds its compile lock and sets the flag as dynamo does; the worker's
    pieces must neither start during it nor see the flag."""
    import threading
    import time

    from torch._dynamo import convert_frame

    model = mlp_of_blocks(n_blocks=2)
    reference = reference_then_offload(model, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    compiling = threading.Event()
    seen: list[bool] = []

    def record(*_):
        if threading.current_thread() is not threading.main_thread():
            compiling.wait(1.0)  # without the lock, the compiler thread is in its session by now
            seen.append(torch.compiler.is_compiling())

    def compiler() -> None:
        with convert_frame.compile_lock, torch.compiler._compile_session_context():
            compiling.set()
            time.sleep(0.3)

    opt.register_step_pre_hook(record)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    report = offtensor.backward_and_step(F.mse_loss(model(x), y), opt, piece_bytes=1)
    thread = threading.Thread(target=compiler)
    thread.start()
    report.wait()
    thread.join()
    assert seen and not any(seen), seen
    F.mse_loss(reference(x), y).backward()
    ref_opt.step()
    assert_params_match(model, reference, rtol=0, atol=0)


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("device", devices)
def test_a_vram_budget_keeping_the_first_block_matches_compiled_unwrapped_model(device):
    """A budget that keeps the first block resident (what hides the first scope's copy, which a
    compiled block cannot start before): compiled blocks read the kept scope's device copy, each
    optimizer step reloads it, training matches and nothing recompiles (train_both)."""
    model = mlp_of_blocks(n_blocks=6)
    budget = (2 + 1 + 1) * device_layout_bytes(model.blocks[0])  # streaming (prefetch 1) + 1 kept
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    assert [s.kept for s in offtensor.summary(model).scopes] == [True] + [False] * 5
    compile_both(model, reference, "blocks", "inductor")
    train_both(model, reference, mlp_batches(device), mse, tolerances(device, "inductor"))
    model.eval(), reference.eval()
    for i, (x, _) in enumerate(mlp_batches(device, 3)):
        with torch.no_grad(), no_recompiles() if i >= 1 else contextlib.nullcontext():
            torch.testing.assert_close(model(x), reference(x), **tolerances(device, "inductor"))
    assert offtensor.summary(model).scopes[0].state is offtensor.ScopeState.RESIDENT  # kept in inference


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("device", devices)
def test_gradient_accumulation_matches_compiled_unwrapped_model(device):
    model, reference = _compiled_mlp_and_reference(device)

    def three_micro_batches(m: nn.Module, batch: tuple) -> torch.Tensor:
        x, y = batch
        for i in range(2):  # two backward calls accumulate into .grad; the third below
            F.mse_loss(m(x[i::3]), y[i::3]).backward()
        return F.mse_loss(m(x[2::3]), y[2::3])

    batches = [(torch.randn(9, 8, device=device), torch.randn(9, 4, device=device)) for _ in range(4)]
    train_both(model, reference, batches, three_micro_batches, tolerances(device, "aot_eager"))


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("device", devices)
def test_lora_with_offloaded_frozen_base_matches_compiled_unwrapped_model(device):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                           lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(small_llama(checkpointing=False), lora)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(param_filter=offtensor.frozen_only))
    compile_both(model, reference, "blocks", "aot_eager")
    batches = [torch.randint(0, 64, (2, 8), device=device) for _ in range(4)]
    train_both(model, reference, batches, lm_loss, tolerances(device, "aot_eager"))


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("device", devices)
def test_blocks_split_into_several_scopes_match_compiled_unwrapped_model(device):
    """Policy(max_scope_bytes) makes each child of a block a scope: the block's graph breaks at
    their boundaries, and the training still matches."""
    model = mlp_of_blocks(n_blocks=2)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(max_scope_bytes=1))
    assert len(offtensor.summary(model).scopes) > 2
    compile_both(model, reference, "blocks", "aot_eager")
    train_both(model, reference, mlp_batches(device), mse, tolerances(device, "aot_eager"))


# --------------------------------------------------------------------------------------------
# What the compiled graphs see
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
def test_a_block_is_one_graph_of_device_copies(device):
    """Each block's forward is one graph, all its ops in it (no graph break inside), and its
    parameter inputs are the scope's device copies, never an OffloadedParameter or a master."""
    model = mlp_of_blocks(n_blocks=3)
    offtensor.wrap(model, device=device)
    model.to(device)
    recorder = GraphRecorder()
    for block in model.blocks:
        block.compile(backend=recorder)
    x = torch.randn(4, 8, device=device)
    model(x).sum().backward()
    masters = {p.untyped_storage().data_ptr() for _, p in offloaded_parameters(model)}

    assert len(recorder.graphs) == 1  # one graph, shared by the three blocks
    gm, inputs = recorder.graphs[0]
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(F.linear) == 2 and F.layer_norm in ops and F.gelu in ops, ops
    params = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
    assert len(params) == 6  # norm, fc1 and fc2 weights and biases
    for t in inputs:
        if isinstance(t, torch.Tensor):
            assert type(t) in (torch.Tensor, nn.Parameter), type(t)
            assert t.device.type == torch.device(device).type
            assert t.untyped_storage().data_ptr() not in masters


def test_graph_breaks_are_only_at_scope_boundaries():
    block = mlp_of_blocks(n_blocks=1)
    offtensor.wrap(block, device="cpu")
    explanation = dynamo.explain(block.blocks[0])(torch.randn(4, 16))
    # The scope's pre-forward and post-forward hooks, nothing else.
    assert explanation.graph_break_count <= 2, explanation.break_reasons
    for reason in explanation.break_reasons:
        assert any("offtensor" in frame.filename for frame in reason.user_stack), reason
    assert sum(len([n for n in g.graph.nodes if n.op == "call_function"]) for g in explanation.graphs) >= 5


class TiedModel(nn.Module):
    """An offloaded embedding whose weight the (unselected) head also reads, in a forward that
    dynamo traces as a whole (no loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.block = ResidualBlock(16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("device", devices)
def test_parameter_read_outside_its_scope_runs_eagerly_and_matches(device, monkeypatch):
    """The tied head reads the embedding's OffloadedParameter in compiled code: the op breaks
    the graph and runs as in eager mode. The compiler's own metadata queries on it (fake tensors)
    must not make device copies."""
    model = TiedModel()
    reference = reference_then_offload(model, device, lambda name, m: name in ("embed", "block"))
    copies_while_compiling = []
    original = Scope.temporary_copy

    def spy(self, slot, op_device, needs_grad):
        if offtensor.dispatch.compile.compiling():
            copies_while_compiling.append(slot.name)
        return original(self, slot, op_device, needs_grad)

    monkeypatch.setattr(Scope, "temporary_copy", spy)
    compile_both(model, reference, "model", "aot_eager")
    batches = [torch.randint(0, 32, (2, 5), device=device) for _ in range(4)]
    train_both(model, reference, batches, lambda m, t: m(t).square().mean(), tolerances(device, "aot_eager"))
    assert copies_while_compiling == []


@pytest.mark.parametrize("device", devices)
def test_parameters_are_restored_when_a_compiled_block_raises(device):
    model = mlp_of_blocks(n_blocks=2)
    offtensor.wrap(model, device=device)
    model.to(device)
    for block in model.blocks:
        block.compile(backend="aot_eager")
    model(torch.randn(4, 8, device=device))
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 7, device=device))  # wrong width: the input Linear raises
    with pytest.raises(RuntimeError):
        model.blocks[0](torch.randn(4, 3, device=device))  # raises inside the compiled block
    assert all(isinstance(p, offtensor.OffloadedParameter) for _, p in offloaded_parameters(model))
    assert_all_scopes_offloaded(model)
    x = torch.randn(4, 8, device=device)
    torch.testing.assert_close(model(x), model(x))


# --------------------------------------------------------------------------------------------
# The compiled backward reads loaded weights only
# --------------------------------------------------------------------------------------------


class LoadedStorageCheck:
    """An AOTAutograd backend whose compiled backward first checks that every tensor it is
    given (the saved device copies among them) has its storage allocated: a backward running
    while its scope is released would read freed memory (Note [torch.compile])."""

    def __init__(self) -> None:
        self.backwards = 0
        self.released_reads: list[tuple[int, ...]] = []

    def backend(self) -> Callable:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def fw(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            return make_boxed_func(gm.forward)

        def bw(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            def run(args: list) -> Any:
                self.backwards += 1
                for t in args:
                    if isinstance(t, torch.Tensor) and t.numel():
                        needed = (t.storage_offset() + t.numel()) * t.element_size()
                        if t.untyped_storage().nbytes() < needed:
                            self.released_reads.append(tuple(t.shape))
                return gm(*args)

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return aot_autograd(fw_compiler=fw, bw_compiler=bw)


@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non_reentrant"])
@pytest.mark.parametrize("device", devices)
def test_compiled_backward_never_reads_a_released_device_copy(device, checkpoint):
    model = mlp_of_blocks(n_blocks=3)
    model.checkpoint = checkpoint
    reference = reference_then_offload(model, device)
    check = LoadedStorageCheck()
    for block in model.blocks:
        block.compile(backend=check.backend())
    for block in reference.blocks:
        block.compile(backend="aot_eager")
    train_both(model, reference, mlp_batches(device, 4), mse, tolerances(device, "aot_eager"))
    assert check.backwards >= 3 * 4
    assert check.released_reads == []


@pytest.mark.full_tier  # compiling costs seconds each: the full tier (CI, GPU check) runs it
@pytest.mark.parametrize("device", devices)
def test_compiled_backward_of_hf_checkpointing_never_reads_a_released_device_copy(device):
    """transformers checkpoints the layer's `forward`, inside its hooks: dynamo traces the
    checkpoint into the layer's graph and the compiled backward recomputes from the saved
    device copies."""
    model = small_llama(checkpointing=True)
    reference = reference_then_offload(model, device)
    check = LoadedStorageCheck()
    model.compile(backend=check.backend())
    reference.compile(backend="aot_eager")
    batches = [torch.randint(0, 64, (2, 8), device=device) for _ in range(3)]
    train_both(model, reference, batches, lm_loss, tolerances(device, "aot_eager"))
    assert check.backwards > 0
    assert check.released_reads == []
