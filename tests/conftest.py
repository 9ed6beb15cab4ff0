"""Shared pieces of the offtensor test suite.

Every behavioural test compares an offloaded model against a plain copy of itself (the
*reference*), made with :func:`unwrapped_reference` *before* ``offtensor.wrap`` runs. The two
models are always run one after the other, never interleaved, so that work done by one can not
hide a missing synchronisation in the other.

Test modules import the helpers below with ``from conftest import ...``.
"""

from __future__ import annotations

import copy
import gc
import io
import os
import random
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

# Test modules say ``from conftest import ...``. Under pytest's default ("prepend") import mode
# this module already is ``conftest``; under ``--import-mode=importlib`` it gets a package-style
# name, so make the plain name resolve to this same module object in both cases.
sys.modules.setdefault("conftest", sys.modules[__name__])
# The helper modules next to this file (tiers, master_guard) import by their plain names too.
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiers  # noqa: E402  (needs the path above)

# --------------------------------------------------------------------------------------------
# Markers and devices
# --------------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    # Registered here rather than (only) in pyproject.toml so that `-m "not cuda"` and
    # `--strict-markers` work whatever configuration file the suite is run with.
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped when none is present")
    config.addinivalue_line("markers", "every_case: the quick tier runs every parametrization of this test")
    config.addinivalue_line("markers", "full_tier: runs only in the full tier (OFFTENSOR_TESTS=full)")
    config.addinivalue_line("markers", "cover(keys): the quick tier runs cases until each key that "
                                       "keys(params) gives for any case has run")


def pytest_report_header(config: pytest.Config) -> str:
    return tiers.header()


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    # Under -q (README's command) pytest prints no header: the seed line comes after collection.
    return [tiers.header()] if config.option.verbose < 0 else []


# Note [freezing what outlives a module]
# After collection the heap holds some 400k objects (torch, transformers, diffusers, and
# torch._dynamo, which the first optimizer step imports), and every full garbage collection
# scans all of them: 0.2 s each, whether Python's own (dozens in a run) or the explicit ones of
# the benchmark and the interrupt fuzzer. So after collection and after each test module, what
# is still alive after a collection is moved out of the collector's sight (gc.freeze). Garbage
# is never frozen (a collection runs first); what a test makes is young and collected as
# before, which is all that tests of object lifetimes (weakrefs, gc.collect) look at.


def pytest_collection_finish(session: pytest.Session) -> None:
    _freeze_the_live_heap()


@pytest.fixture(autouse=True, scope="module")
def _freeze_what_outlives_a_module() -> Iterator[None]:
    yield
    _freeze_the_live_heap()


def _freeze_the_live_heap() -> None:
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    gc.unfreeze()


# --------------------------------------------------------------------------------------------
# The quick tier's sample of parametrized tests
# --------------------------------------------------------------------------------------------

# Note [quick tier covers every parameter value]
# In the quick tier (tiers.py) a test parametrized over two or more arguments runs only enough
# of its cases that every value of every argument runs at least once: the zero_grad matrix runs
# each placement of zero_grad, each checkpointing kind, split and whole scopes, step and
# backward_and_step, but not every combination; the architecture matrix runs every
# architecture once and every mode at least once. Which combinations run rotates with the
# sample seed. A test over one argument runs all its cases (they are distinct checks, often
# distinct error paths), as does a test marked ``every_case``. A test marked ``cover(keys)``
# says itself what must be covered: ``keys(params)`` gives a case's keys (the architecture
# matrix: its architecture's family and its mode). CUDA cases are sampled apart
# from CPU ones, so that a value is never covered only by a case that the CPU machine skips.
# A test marked ``full_tier`` runs only in the full tier (the two-process distributed test: two
# fresh interpreters importing torch take longer than the rest of the quick tier's CPU tests).
# The hook runs after ``-k``/``-m`` selection: whatever is selected by hand is sampled again
# among itself, so ``-k "llama"`` still runs llama in every mode.


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if tiers.FULL:
        return
    dropped = {id(item) for item in items if item.get_closest_marker("full_tier") is not None}
    groups: dict[tuple[str, bool], list[pytest.Item]] = defaultdict(list)
    for item in items:
        if id(item) in dropped:
            continue
        params = _sampled_params(item)
        if params is not None and (len(params) >= 2 or item.get_closest_marker("cover") is not None):
            groups[(item.nodeid.split("[")[0], item.get_closest_marker("cuda") is not None)].append(item)
    for (name, on_cuda), group in groups.items():
        kept = {id(item) for item in tiers.cover(group, _cover_keys, f"{name}:{on_cuda}")}
        dropped.update(id(item) for item in group if id(item) not in kept)
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if id(item) in dropped])
        items[:] = [item for item in items if id(item) not in dropped]


def _sampled_params(item: pytest.Item) -> dict[str, object] | None:
    """The parameters the quick tier samples over (``device`` apart), or None for a test that
    runs in full."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or item.get_closest_marker("every_case") is not None:
        return None
    return {k: v for k, v in callspec.params.items() if k != "device"}


def _cover_keys(item: pytest.Item) -> set[object]:
    params = _sampled_params(item) or {}
    marker = item.get_closest_marker("cover")
    if marker is not None:
        return set(marker.args[0](params))
    # repr: parameter values may be unhashable (dicts of options); one object per value.
    return {(k, repr(v)) for k, v in params.items()}


HAS_CUDA = torch.cuda.is_available()

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

#: Parametrize a test over every compute device: ``@pytest.mark.parametrize("device", devices)``.
#: ``device="cpu"`` runs the full offload mechanism on the CPU, which is how CI (no GPU) covers it.
devices = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, requires_cuda]),
]

#: The kinds of torch.utils.checkpoint a block of `mlp_of_blocks` may use (its `checkpoint`).
CHECKPOINTING = [
    pytest.param(None, id="no_checkpointing"),
    pytest.param("reentrant", id="reentrant"),
    pytest.param("non_reentrant", id="non_reentrant"),
]


#: Floating point types the parity tests run in.
dtypes = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
]


def tolerances(device: str, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """``assert_close`` tolerances for comparing an offloaded model against its reference.

    On the CPU both models run the very same kernels on bit-identical weights in the same order
    (the offloaded one on a copy of them), so results must be bit-identical: rtol=atol=0.

    On CUDA the forward/backward kernels are again the same, but the optimizer steps the
    offloaded masters on the CPU while the reference steps on the GPU (foreach kernels, FMA
    contraction), so weights may differ in the last bits after a step and that difference
    propagates. The tolerances are a few ulps of the dtype.
    """
    if device == "cpu":
        return {"rtol": 0.0, "atol": 0.0}
    if dtype == torch.bfloat16:
        # atol is about one AdamW/Adagrad step (lr=1e-2): for an element whose gradient is
        # near zero, a last-bit difference can flip its sign, and adaptive optimizers turn that
        # into a full-size step in the other direction.
        return {"rtol": 2e-2, "atol": 1e-2}
    if dtype == torch.float16:
        return {"rtol": 2e-3, "atol": 1e-4}
    return {"rtol": 1e-4, "atol": 1e-5}


# --------------------------------------------------------------------------------------------
# Seeding
# --------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def lagging_side_streams() -> Iterator[None]:
    """OFFTENSOR_LAZY_STREAMS=1: every test runs with side streams that lag on the CPU (Note
    [lazy streams] in tests/lazy_streams.py), so that a missing wait fails there too."""
    if os.environ.get("OFFTENSOR_LAZY_STREAMS") != "1":
        yield
        return
    from lazy_streams import lazy_streams

    with lazy_streams():
        yield


@pytest.fixture(autouse=True)
def seed() -> int:
    """Seed every RNG before each test so model initialisation and inputs are reproducible."""
    value = 0
    random.seed(value)
    torch.manual_seed(value)  # also seeds every CUDA device
    return value


# --------------------------------------------------------------------------------------------
# Small models
# --------------------------------------------------------------------------------------------


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny matrices: one intra-op thread is fastest, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class WritingBlock(nn.Module):
    """A Linear whose forward first writes its weight in place, under no_grad, one way per `form`
    ("add_", "data", "data=", "copy_", "setitem"; "none" writes nothing), then reads it."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.fc.weight
        with torch.no_grad():
            if self.form == "add_":
                w.add_(1.0)
            elif self.form == "data":
                w.data.mul_(2)
            elif self.form == "data=":
                w.data = w.detach() * 0.5 + 0.25
            elif self.form == "copy_":
                w.copy_(w.clamp(-0.2, 0.2) + 0.1)  # changes the weight at every call
            elif self.form == "setitem":
                w[0] = w[0] * 2 + 1
        return self.fc(x)


class ResidualBlock(nn.Module):
    """Pre-norm residual MLP block: ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, hidden: int, expansion: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, expansion * hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(expansion * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class BatchNormBlock(nn.Module):
    """``x + relu(bn(fc(x)))``: has running-statistics buffers that change in training."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        # No bias before a BatchNorm: its gradient would be pure rounding noise, which Adam
        # turns into full-size steps that differ between CPU and CUDA kernels.
        self.fc = nn.Linear(hidden, hidden, bias=False)
        self.bn = nn.BatchNorm1d(hidden)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.bn(self.fc(x)))


class BlockStack(nn.Module):
    """``input`` Linear -> ``blocks`` (an ``nn.ModuleList``) -> ``head`` Linear.

    With the default predicate the elements of ``blocks`` are the scopes; ``input`` and
    ``head`` stay plain parameters that the user places on the compute device.

    ``checkpoint`` selects activation checkpointing per block: ``None`` (off), ``"reentrant"``
    or ``"non_reentrant"`` (``torch.utils.checkpoint.checkpoint`` with ``use_reentrant`` set
    accordingly). It only applies while the module is in training mode, like transformers.
    """

    def __init__(
        self,
        blocks: list[nn.Module],
        in_features: int,
        hidden: int,
        out_features: int,
    ) -> None:
        super().__init__()
        self.input = nn.Linear(in_features, hidden)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(hidden, out_features)
        self.checkpoint: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input(x)
        for block in self.blocks:
            if self.checkpoint is not None and self.training:
                h = torch.utils.checkpoint.checkpoint(
                    block, h, use_reentrant=self.checkpoint == "reentrant"
                )
            else:
                h = block(h)
        return self.head(h)


def mlp_of_blocks(
    n_blocks: int = 3,
    hidden: int = 16,
    in_features: int = 8,
    out_features: int = 4,
    dtype: torch.dtype = torch.float32,
    checkpoint: str | None = None,
) -> BlockStack:
    """An input Linear, ``n_blocks`` Linear/LayerNorm/GELU residual blocks, a Linear head;
    ``checkpoint`` as :class:`BlockStack`'s (a reference deep-copied from it keeps it)."""
    blocks = [ResidualBlock(hidden) for _ in range(n_blocks)]
    model = BlockStack(blocks, in_features, hidden, out_features).to(dtype)
    model.checkpoint = checkpoint
    return model


def batchnorm_model(n_blocks: int = 3, hidden: int = 16, in_features: int = 8) -> BlockStack:
    """Like :func:`mlp_of_blocks` but each block holds a ``BatchNorm1d``."""
    blocks = [BatchNormBlock(hidden) for _ in range(n_blocks)]
    return BlockStack(blocks, in_features, hidden, out_features=4)


class MixedDtypeBlock(nn.Module):
    """An fp32 norm before a bf16 matrix in one block (transformers' _keep_in_fp32_modules)."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x).to(torch.bfloat16)).float()


class HeadBlock(nn.Module):
    """Final norm and the output projection, as the last element of ``blocks``."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class TiedLM(nn.Module):
    """A tiny language model whose input embedding and output projection share one Parameter.

    ``tied_side`` says where the two users of the shared weight live relative to the scopes:

    - ``"head_in_block"``: the output projection is inside the last element of ``blocks`` (so
      inside a scope under the default predicate) while ``embed`` is an ordinary module.
    - ``"embedding_selected"``: the output projection ``head`` is an ordinary module and
      ``embed`` is made a scope by :data:`TIED_EMBEDDING_PREDICATE`.

    Either way the shared Parameter is offloaded and also used outside its scope.
    """

    def __init__(
        self, tied_side: str, vocab: int = 32, hidden: int = 16, n_blocks: int = 2
    ) -> None:
        super().__init__()
        if tied_side not in ("head_in_block", "embedding_selected"):
            raise ValueError(tied_side)
        self.tied_side = tied_side
        self.embed = nn.Embedding(vocab, hidden)
        blocks: list[nn.Module] = [ResidualBlock(hidden) for _ in range(n_blocks)]
        if tied_side == "head_in_block":
            head_block = HeadBlock(hidden, vocab)
            head_block.proj.weight = self.embed.weight
            blocks.append(head_block)
            self.head = None
        else:
            self.head = nn.Linear(hidden, vocab, bias=False)
            self.head.weight = self.embed.weight
        self.blocks = nn.ModuleList(blocks)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return h if self.head is None else self.head(h)


def tied_lm(tied_side: str) -> TiedLM:
    return TiedLM(tied_side)


def tied_lm_predicate(tied_side: str) -> Callable[[str, nn.Module], bool] | None:
    """The predicate to wrap a :class:`TiedLM` with (``None`` means the default predicate)."""
    if tied_side == "head_in_block":
        return None
    return lambda name, module: name == "embed" or re.fullmatch(r"blocks\.\d+", name) is not None


def only_blocks(*indices: int) -> Callable[[str, nn.Module], bool]:
    """A predicate that selects ``blocks.<i>`` for the given indices and nothing else."""
    names = {f"blocks.{i}" for i in indices}
    return lambda name, module: name in names


# --------------------------------------------------------------------------------------------
# Reference copies and wrapping
# --------------------------------------------------------------------------------------------


def unwrapped_reference(model: nn.Module, device: str) -> nn.Module:
    """A deep copy of ``model`` entirely on ``device``: the plain PyTorch behaviour to match.

    Must be called BEFORE ``offtensor.wrap(model)``; it never sees an OffloadedParameter.
    """
    import offtensor

    assert not offtensor.is_wrapped(model), "make the reference before wrapping"
    return copy.deepcopy(model).to(device)


def offload(model: nn.Module, device: str, predicate=None, **kwargs) -> nn.Module:
    """``offtensor.wrap`` on ``device``, then place buffers and unselected parameters there.

    This is the documented way to use the library: wrap first, then ``model.to(device)``,
    which moves everything except the offloaded masters.
    """
    import offtensor

    offtensor.wrap(model, predicate, device=device, **kwargs)
    model.to(device)
    return model


def reference_then_offload(model: nn.Module, device: str, predicate=None, **kwargs) -> nn.Module:
    """The unwrapped reference of ``model`` on ``device`` (made first), then ``offload(model,
    ...)``: the usual start of a parity test. Returns the reference."""
    reference = unwrapped_reference(model, device)
    offload(model, device, predicate, **kwargs)
    return reference


def split_policy(model: BlockStack):
    """``Policy(max_scope_bytes=<half a block>)``: each block splits into a scope per child."""
    import offtensor

    return offtensor.Policy(max_scope_bytes=param_bytes(model.blocks[0]) // 2)


def mlp_and_reference(device: str, *, split: bool = False, checkpoint: str | None = None,
                      n_blocks: int = 3) -> tuple[BlockStack, BlockStack]:
    """:func:`mlp_of_blocks` with ``checkpoint``, offloaded on ``device`` (with ``split``, in
    scopes of half a block: :func:`split_policy`), and its unwrapped reference, made first."""
    model = mlp_of_blocks(n_blocks=n_blocks, checkpoint=checkpoint)
    reference = reference_then_offload(model, device, policy=split_policy(model) if split else None)
    return model, reference


def offloaded_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    import offtensor

    for name, p in model.named_parameters():
        if isinstance(p, offtensor.OffloadedParameter):
            yield name, p


def param_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters (a block's size, for Policy(max_scope_bytes=...))."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def device_layout_bytes(module: nn.Module) -> int:
    """The module's weights as a scope lays them out on the device (each parameter aligned to
    256 bytes): what a block takes of Policy(vram_budget=...)."""
    return max(256, sum(-(-p.numel() * p.element_size() // 256) * 256 for p in module.parameters()))


def host(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU tensor with the values of ``t`` (parameter, master or device tensor)."""
    return t.detach().to("cpu").as_subclass(torch.Tensor)


def random_batch(device: str, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for :func:`mlp_of_blocks` (8 in, 4 out)."""
    return torch.randn(n, 8).to(device), torch.randn(n, 4).to(device)


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``F.mse_loss(model(x), y)`` for an ``(x, y)`` batch: :func:`train_adamw`'s default."""
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def train_adamw(model: nn.Module, batches, make_optimizer=None, loss_fn=mse_loss) -> torch.Tensor:
    """One optimizer step per batch (``loss_fn(model, batch)``, MSE of an (x, y) batch by
    default; AdamW lr=1e-2 over the trainable parameters by default); the losses."""
    make_optimizer = make_optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(host(loss))
    return torch.stack(losses)


def assert_trains_like(model: nn.Module, reference: nn.Module, batches, device: str, *,
                       grads: bool = False, **train_kwargs) -> None:
    """:func:`train_adamw` on the reference, then on ``model``: losses and parameters (and, with
    ``grads``, the last gradients) match."""
    expected = train_adamw(reference, batches, **train_kwargs)
    losses = train_adamw(model, batches, **train_kwargs)
    torch.testing.assert_close(losses, expected, **tolerances(device))
    if grads:
        assert_grads_match(model, reference, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))


def step_both(model: nn.Module, reference: nn.Module, opt: torch.optim.Optimizer,
              ref_opt: torch.optim.Optimizer, tol: dict[str, float]) -> None:
    """After both models' backward: gradients match, then both step and zero their grads."""
    assert_grads_match(model, reference, **tol)
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()


def train_step(loss: torch.Tensor, opt: torch.optim.Optimizer, *, overlap: bool) -> None:
    """One optimizer step on `loss`: `offtensor.backward_and_step(loss, opt, zero_grad=True)`
    when `overlap`, else backward, step and zero_grad."""
    import offtensor

    if overlap:
        offtensor.backward_and_step(loss, opt, zero_grad=True)
    else:
        loss.backward()
        opt.step()
        opt.zero_grad()


def assert_params_match(model: nn.Module, reference: nn.Module, **tol) -> None:
    """Every parameter and buffer of ``model`` equals the reference's, by qualified name."""
    _assert_same_tensors(dict(model.named_parameters()), dict(reference.named_parameters()), **tol)
    _assert_same_tensors(dict(model.named_buffers()), dict(reference.named_buffers()), **tol)


def _assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], **tol) -> None:
    assert got.keys() == expected.keys()
    for name, t in got.items():
        torch.testing.assert_close(
            host(t), host(expected[name]), msg=lambda m, name=name: f"{name}: {m}", **tol
        )


def assert_grads_match(model: nn.Module, reference: nn.Module, **tol) -> None:
    """``p.grad`` of every parameter equals the reference's (``None`` where it is ``None``)."""
    params = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        ref_grad = ref_params[name].grad
        if ref_grad is None:
            assert p.grad is None, f"{name}: has a grad, the reference has none"
            continue
        assert p.grad is not None, f"{name}: has no grad, the reference has one"
        torch.testing.assert_close(
            host(p.grad), host(ref_grad), msg=lambda m, name=name: f"{name}: {m}", **tol
        )


def assert_backward_matches(model: nn.Module, out: torch.Tensor, reference: nn.Module, x: torch.Tensor,
                            y: torch.Tensor, device: str) -> None:
    """MSE backward from the offloaded model's output ``out`` and from the reference's output
    for ``x``: outputs and grads match, and no scope is left on the device."""
    import torch.nn.functional as F

    F.mse_loss(out, y).backward()
    ref_out = reference(x)
    F.mse_loss(ref_out, y).backward()
    torch.testing.assert_close(out, ref_out, **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)


def scope_states(model: nn.Module) -> dict[str, object]:
    import offtensor

    return {s.name: s.state for s in offtensor.summary(model).scopes}


def assert_all_scopes_offloaded(model: nn.Module) -> None:
    """No scope holds a device copy: every state is OFFLOADED and device_bytes is 0; except
    the scopes Policy(vram_budget=...) keeps or a backward carried for the next forward, which
    hold exactly their weights, equal to the masters (a stale copy would be a silent wrong
    answer at the next forward); a load of theirs still in flight is waited for first."""
    import offtensor
    from offtensor.engine.engine import find_engine as _find_engine

    scopes = offtensor.summary(model).scopes
    assert scopes, "summary() lists no scope"
    engine = _find_engine(model)
    for s in scopes:
        if (s.kept or s.carried) and s.state != offtensor.ScopeState.OFFLOADED:
            scope = next(x for x in engine.scopes if x.name == s.name)
            assert s.device_bytes == scope.device.nbytes, f"{s.name} holds {s.device_bytes} device bytes"
            if scope.state is offtensor.ScopeState.LOADING:  # carried by an inference pass's end
                scope.make_resident()
            if scope.device.flat.is_cuda:
                torch.cuda.synchronize()
            for slot in scope.slots:
                values = slot.packed.unpack() if slot.packed is not None else slot.master  # frozen_format
                fresh = values.to(slot.device_view.dtype)
                # Bit for bit; a training run that diverged holds NaN in both (NaN != NaN)
                torch.testing.assert_close(slot.device_view.cpu(), fresh, rtol=0, atol=0, equal_nan=True,
                                           msg=lambda m, name=slot.name: f"{name}: device copy is stale: {m}")
            continue
        assert s.state == offtensor.ScopeState.OFFLOADED, f"{s.name} is {s.state} after the step"
        assert s.device_bytes == 0, f"{s.name} still holds {s.device_bytes} device bytes"


def small_llama(checkpointing: bool) -> nn.Module:
    """A 2-layer ``LlamaForCausalLM`` (hidden 32, vocab 64, random weights) in training mode,
    with transformers' activation checkpointing on or off. Skips when transformers is absent."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = transformers.LlamaForCausalLM(config)
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    model.train()
    return model


def tiny_qwen3_moe() -> nn.Module:
    """A 2-layer ``Qwen3MoeForCausalLM`` (16 experts, top 2, transformers' grouped_mm experts,
    random weights) in eval mode. Skips when transformers is absent."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=None, bos_token_id=None,
        moe_intermediate_size=32, num_experts=16, num_experts_per_tok=2, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.config._experts_implementation = "grouped_mm"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "gate" in name:
                p.normal_(0, 0.2)  # routers initialised to zero would pick the same experts
    return model.eval()


@pytest.fixture
def most_device_bytes(monkeypatch):
    """The largest sum of the scopes' device weights seen right after any load starts (the
    budget bounds weights; old gradients fetched for accumulation come on top)."""
    seen = [0]
    from offtensor.scopes import scope as _scope

    real = _scope.Scope._start_load

    def spy(scope):
        real(scope)
        seen[0] = max(seen[0], sum(s.device.storage.nbytes() for s in scope.engine.scopes))

    monkeypatch.setattr(_scope.Scope, "_start_load", spy)
    return seen


def fuzz_optimizer(cfg: dict, model: nn.Module) -> torch.optim.Optimizer:
    """The fuzzers' optimizer: cfg["optimizer"] (sgd, adamw, adagrad), over all parameters or the
    trainable ones (cfg["opt_over"]), foreach or not, with cfg["weight_decay"] if drawn."""
    params = [p for p in model.parameters() if cfg["opt_over"] == "all" or p.requires_grad]
    decay = cfg.get("weight_decay")
    options = {"foreach": cfg["foreach"], **({} if decay is None else {"weight_decay": decay})}
    if cfg["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, **options)
    if cfg["optimizer"] == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, **options)
    return torch.optim.Adagrad(params, lr=0.05, **options)


class FuzzError(Exception):
    """Raised by an armed `Trap` in a scope's forward: the fuzzers' models both raise it alike."""


class Trap:
    """A forward hook that raises FuzzError once, when armed (the fuzzers' failing forwards)."""

    def __init__(self) -> None:
        self.armed = False

    def __call__(self, module, args, output):
        if self.armed:
            self.armed = False
            raise FuzzError("raised by the fuzzer's forward hook")
        return None


def copy_of(obj, how: str):
    """`obj` deep-copied (`how="deepcopy"`), or saved with torch.save and loaded back."""
    if how == "deepcopy":
        return copy.deepcopy(obj)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


class BlocksOf(nn.Module):
    """`n` blocks of one kind (each built by `kind()`), called in turn."""

    def __init__(self, kind, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([kind() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x
