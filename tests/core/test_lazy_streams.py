"""The CUDA stream and event protocol, checked on the CPU with side streams that lag (Note [lazy
streams] in tests/lazy_streams.py): a forward, a backward and an optimizer step of streamed,
kept and compressed models match the plain model while every copy and conversion runs as late
as its events allow, and no queued work outlives the memory it writes."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import BlockStack, assert_all_scopes_offloaded, mlp_of_blocks, random_batch, tiny_qwen3_moe
from lazy_streams import lazy_streams
from torch import nn

import offtensor
import offtensor.scopes.loading as loading_module
from offtensor.dispatch import param as param_module
from offtensor.scopes.loading import LoadProgress
from offtensor.storage.compress import MIN_NUMEL, quantize_dequantize

HIDDEN = 64  # 64 x 64 block matrices: MIN_NUMEL elements, compressed by a frozen format


class _Boom(Exception):
    pass


class AdapterBlock(nn.Module):
    """A frozen matrix (compressed by a frozen format) used first, a trainable adapter (never
    compressed) used last: a converting load whose last chunks convert nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.adapter = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.adapter(F.gelu(self.fc(x)))


def _model(kind: str, checkpoint: str | None = None) -> BlockStack:
    if kind == "adapters":
        model = BlockStack([AdapterBlock() for _ in range(3)], 8, HIDDEN, 4)
        model.checkpoint = checkpoint
        return model
    return mlp_of_blocks(hidden=HIDDEN, checkpoint=checkpoint)


def _compressed_copy(model: nn.Module, fmt: str | None) -> nn.Module:
    reference = copy.deepcopy(model)
    if fmt is not None:
        with torch.no_grad():
            for p in reference.blocks.parameters():
                if p.dim() >= 2 and not p.requires_grad and p.numel() >= MIN_NUMEL:
                    p.copy_(quantize_dequantize(p, fmt))
    return reference


def _train(model: nn.Module, steps: int) -> list[torch.Tensor]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    torch.manual_seed(1)
    for _ in range(steps):
        x, y = random_batch("cpu")
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


POLICIES = {
    "streamed": {},
    "kept": {"vram_budget": 2**40},
    "fp8": {"frozen_format": "fp8"},
    "int8-prefetch-2": {"frozen_format": "int8", "prefetch": 2},
}


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_training_with_lagging_side_streams_matches_the_plain_model(policy, checkpoint, monkeypatch):
    monkeypatch.setattr(loading_module, "CHUNK_BYTES", 4096)  # several chunks per scope
    fmt = POLICIES[policy].get("frozen_format")
    model = _model("adapters" if fmt is not None else "mlp", checkpoint)
    reference = _compressed_copy(model, fmt)
    expected = _train(reference, 4)
    with lazy_streams() as made:
        offtensor.wrap(model, device="cpu", policy=offtensor.Policy(**POLICIES[policy]))
        losses = _train(model, 4)
        assert any(stream.issued for stream in made), "nothing went through a side stream"
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=0, atol=0)
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_a_forward_that_raises_mid_load_frees_no_memory_a_conversion_still_writes(fmt, monkeypatch):
    """An exception while a converting load's chunks are in flight: the release waits for every
    conversion, not only the last chunk's event (Note [a release after a load's last event] in
    scopes/loading.py); the next forward matches the compressed plain model."""
    monkeypatch.setattr(loading_module, "CHUNK_BYTES", 4096)
    model = _model("adapters")
    reference = _compressed_copy(model, fmt)
    x = torch.randn(4, 8)
    with lazy_streams():
        offtensor.wrap(model, device="cpu", policy=offtensor.Policy(frozen_format=fmt, prefetch=2))
        model(x)  # learns the copy order: later loads are progressive, chunk by chunk

        def boom(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            raise _Boom

        handle = model.blocks[0].fc.register_forward_hook(boom)  # the next blocks are being prefetched
        with pytest.raises(_Boom), torch.no_grad():
            model(x)
        handle.remove()
        assert_all_scopes_offloaded(model)
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "in flight"])
def test_a_scope_whose_load_landed_before_its_call_takes_no_torch_function(landed, monkeypatch):
    """Note [a load that landed before its call] (engine/hooks.py): a prefetched scope whose
    copies have all run when its call starts has its copies in the modules for the whole call,
    so no op takes `__torch_function__`; one whose copies are still queued takes the per-op
    path, each op waiting for its chunk. Both exact."""
    monkeypatch.setattr(loading_module, "CHUNK_BYTES", 4096)  # several chunks per scope
    model = mlp_of_blocks(hidden=HIDDEN)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    calls: list[tuple[int, object]] = []  # (block, function)
    where = [-1]
    real = param_module.OffloadedParameter.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        calls.append((where[0], func))
        return real(cls, func, types, args, kwargs)

    with lazy_streams() as made:
        for i, block in enumerate(model.blocks):  # before wrap: runs before offtensor's pre-hook
            def enter(module: nn.Module, args: tuple, i: int = i) -> None:
                where[0] = i
                if landed:  # every copy queued so far runs: the prefetched loads land
                    for stream in made:
                        stream.run_until(stream.issued)

            block.register_forward_pre_hook(enter)
        offtensor.wrap(model, device="cpu", policy=offtensor.Policy(prefetch=2))
        with torch.no_grad():
            model(x)  # learns the copy order: later loads are progressive
            monkeypatch.setattr(param_module.OffloadedParameter, "__torch_function__", classmethod(counting))
            out = model(x)
        prefetched = [f for i, f in calls if i > 0]  # the first block loads in its own pre-hook
    assert not prefetched if landed else prefetched, prefetched
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


def test_lagging_side_streams_fail_a_load_that_compute_does_not_wait_for(monkeypatch):
    """The check itself: with the compute stream's waits for a load's chunks taken out, the
    outputs are wrong (read before the copies ran), as they could be on a GPU."""
    monkeypatch.setattr(LoadProgress, "compute_waits", lambda self, chunk: not self.held_back)
    model = mlp_of_blocks(hidden=HIDDEN)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    with pytest.raises(AssertionError), lazy_streams():
        offtensor.wrap(model, device="cpu")
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


@pytest.mark.skipif(os.environ.get("OFFTENSOR_LAZY_STREAMS") == "1", reason="every test lags in this mode")
def test_streams_are_themselves_again_after_lagging_side_streams():
    """The patch is undone: the next test's models get the CPU's streams (None) and copies."""
    before = {name: vars(offtensor.scopes.streams.Streams)[name] for name in ("record", "wait", "compute", "on")}
    with lazy_streams():
        pass
    after = {name: vars(offtensor.scopes.streams.Streams)[name] for name in ("record", "wait", "compute", "on")}
    assert after == before
    assert offtensor.scopes.streams.Streams.record(None) is None
    model = mlp_of_blocks(hidden=HIDDEN)
    reference = copy.deepcopy(model)
    offtensor.wrap(model, device="cpu")
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert all(s is None for s in offtensor.engine.engine.find_engine(model).streams._side.values())


def test_a_release_after_an_interrupt_before_compute_waits_for_expert_copies_waits_for_them():
    """Note [copies an interrupt left] (scopes/streams.py): a KeyboardInterrupt after a routed
    expert's rows are enqueued on the copy stream and before compute waits for their event.
    Regression: the scope's release freed its buffer while the copy was still queued to write
    it (on a GPU, into memory the allocator may have handed on). The next forward matches the
    plain model."""
    model = tiny_qwen3_moe()
    reference = copy.deepcopy(model)
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    with lazy_streams(), torch.no_grad():
        offtensor.wrap(model, device="cpu")
        model(ids)  # learns the orders: the next forward copies the routed experts' rows
        streams = model._offtensor_engine.streams
        real_wait = streams.wait

        def wait(stream: object, event: object) -> None:
            if sys._getframe(1).f_code.co_name == "_copy":  # ExpertRows._copy, once
                del streams.wait
                raise KeyboardInterrupt
            real_wait(stream, event)

        streams.wait = wait  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            model(ids)
        assert "wait" not in vars(streams), "the interrupt did not come"
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("where", ["after its copies", "before its copies"])
@pytest.mark.parametrize("error", [_Boom, KeyboardInterrupt])
def test_a_load_that_raises_before_its_scope_is_loading_frees_its_device_buffer(where, error, monkeypatch):
    """A load that raises between its allocation and LOADING (a file read, a converting load's
    staging, an interrupt in its copies: Note [scope states] in scopes/scope.py) leaves its scope
    OFFLOADED with no device memory, freed after the copies it enqueued ran (the lazy streams
    report a free under queued work), and the next forward matches the plain model. Regression:
    the buffer stayed allocated until the scope's next load."""
    monkeypatch.setattr(loading_module, "CHUNK_BYTES", 4096)  # several chunks per scope
    model = mlp_of_blocks(hidden=HIDDEN)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    with lazy_streams() as made, torch.no_grad():
        offtensor.wrap(model, device="cpu", policy=offtensor.Policy(prefetch=2))
        model(x)  # learns the orders: the next loads are progressive and prefetched
        engine = model._offtensor_engine
        target = engine.scopes[1]
        source = type(target.source)
        hook = "after_load" if where == "after its copies" else "acquire"
        real = getattr(source, hook)

        def failing(self, scope, *args):
            if scope is target:
                raise error
            return real(self, scope, *args)

        monkeypatch.setattr(source, hook, failing)
        queued = sum(stream.issued for stream in made)
        with pytest.raises(error):
            model(x)
        if where == "after its copies":
            assert sum(stream.issued for stream in made) > queued, "the failed load enqueued no copy"
        assert target.state is offtensor.ScopeState.OFFLOADED
        assert target.device.storage.nbytes() == 0, "the failed load's buffer is still allocated"
        monkeypatch.setattr(source, hook, real)
        if error is _Boom:  # (an interrupted forward's other scopes go at the next forward)
            assert_all_scopes_offloaded(model)
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
