"""Policy(layout="timed") and vram_budget="auto": the VRAM budget's kept scopes chosen from the
second pass's measured times (Note [a timed layout] in budget/layout.py), checked against the unwrapped
model over several steps, with the layout applied between passes and bounded by the budget."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_grads_match,
    assert_params_match,
    device_layout_bytes,
    mlp_of_blocks,
    random_batch,
    reference_then_offload,
)

import offtensor
from offtensor.budget import timed as _timed
from offtensor.budget.layout import ScopeCost, choose, min_room, simulate

GiB = 2**30


def _costs(pattern: str) -> list[ScopeCost]:
    """'d': a block that copies four times longer than it computes, 's': under twice."""
    shapes = {"d": (3.0, 12.5, 680), "s": (2.6, 5.2, 283)}
    return [ScopeCost(shapes[k][0], 0.0, shapes[k][1], shapes[k][2] * 2**20, str(i)) for i, k in enumerate(pattern)]


def test_simulated_pass_is_compute_when_all_kept_and_copies_when_all_streamed():
    costs = _costs("d" * 6)
    order = list(range(6))
    assert simulate(costs, order, [], set(order), 10 * GiB).forward_ms == pytest.approx(18.0)
    streamed = simulate(costs, order, [], set(), 3 * 680 * 2**20).forward_ms
    assert streamed == pytest.approx(6 * 12.5 + 3.0)  # the link never idles; the last compute follows


def test_choose_beats_the_byte_spread_on_mixed_blocks_and_keeps_the_streaming_room():
    costs = _costs("d" * 19 + "s" * 38)
    order = list(range(len(costs)))
    budget = 16 * GiB
    spread = {i for i in order if i % 5 in (0, 2, 3)}  # about what the byte layout keeps
    spread_room = 3 * 680 * 2**20
    kept, pred = choose(costs, order, [], budget, prefetch=1)
    used = sum(costs[i].device_bytes for i in kept)
    assert budget - used >= min_room(costs, kept, 1)
    assert pred.forward_ms < 0.95 * simulate(costs, order, [], spread, spread_room).forward_ms
    assert pred.forward_ms == pytest.approx(simulate(costs, order, [], kept, budget - used).forward_ms)


def _kept(model) -> list[str]:
    return [s.name for s in offtensor.summary(model).scopes if s.kept]


def _train(model, reference, steps: int = 5) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = random_batch("cpu")
        for m, o in ((reference, ref_opt), (model, opt)):
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
        if step == 1:
            assert offtensor.summary(model).layout.predicted_forward_ms is None  # measured, not chosen yet


def test_timed_layout_training_matches_unwrapped_and_summary_shows_the_prediction():
    model = mlp_of_blocks(n_blocks=6)
    budget = 4 * device_layout_bytes(model.blocks[0])
    reference = reference_then_offload(model, "cpu", policy=offtensor.Policy(vram_budget=budget, layout="timed"))
    _train(model, reference)
    assert_params_match(model, reference, rtol=0, atol=0)
    layout = offtensor.summary(model).layout
    assert layout.timed and layout.budget == budget
    assert layout.predicted_forward_ms > 0 and layout.predicted_backward_ms > 0
    assert layout.kept_bytes + min(device_layout_bytes(b) for b in model.blocks) * 3 <= budget
    assert "predicted forward" in str(offtensor.summary(model))


def test_the_chosen_layout_is_applied_between_passes(monkeypatch):
    model = mlp_of_blocks(n_blocks=6)
    block = device_layout_bytes(model.blocks[0])
    reference = reference_then_offload(model, "cpu", policy=offtensor.Policy(vram_budget=5 * block, layout="timed"))
    assert _kept(model) == ["blocks.0", "blocks.5"]  # by bytes until the layout is timed
    chosen = {}

    def pick(costs, forward, backward, budget, prefetch):
        chosen["forward"] = list(forward)
        return {4, 5}, simulate(costs, forward, backward, {4, 5}, budget - 2 * block)

    monkeypatch.setattr(_timed, "choose", pick)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert chosen["forward"] == [0, 1, 2, 3, 4, 5]
    assert _kept(model) == ["blocks.4", "blocks.5"]
    rows = {s.name: s for s in offtensor.summary(model).scopes}
    assert rows["blocks.4"].device_bytes > 0
    # Block 0 is streamed now: between inference calls only carried into the next one (Note
    # [carried into the next forward] in budget/vram.py), with block 1, in the room beside blocks 4 and 5.
    assert [n for n, r in rows.items() if r.device_bytes and not r.kept] == ["blocks.0", "blocks.1"]
    assert rows["blocks.0"].carried and rows["blocks.1"].carried


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_a_new_layout_releases_what_was_carried_for_the_old_one(training, monkeypatch, most_device_bytes):
    """Scopes carried into the next forward are chosen for the layout's streaming room (Note
    [carried into the next forward] in budget/vram.py); a new layout that keeps more leaves less
    room, and they would stand beside the new pass's streamed scopes over the budget. So the
    measured pass carries nothing (the next one starts with the new layout), and a new layout
    releases what is carried. Regression: six blocks' weights on the device under a five-block
    budget; results exact either way."""
    model = mlp_of_blocks(n_blocks=6)
    block = device_layout_bytes(model.blocks[0])
    budget = 5 * block
    reference = reference_then_offload(model, "cpu", policy=offtensor.Policy(vram_budget=budget, layout="timed"))
    assert _kept(model) == ["blocks.0", "blocks.5"]  # by bytes until the layout is timed

    def pick(costs, forward, backward, budget, prefetch):  # keeps the last three: room for two
        return {3, 4, 5}, simulate(costs, forward, backward, {3, 4, 5}, budget - 3 * block)

    monkeypatch.setattr(_timed, "choose", pick)
    for _ in range(4):
        carried = [s.name for s in offtensor.summary(model).scopes if s.carried]
        x, y = random_batch("cpu")
        if training:
            out = model(x)
            torch.nn.functional.mse_loss(out, y).backward()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            assert_grads_match(model, reference, rtol=0, atol=0)
        else:
            with torch.no_grad():
                out = model(x)
        torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
        if _kept(model) == ["blocks.3", "blocks.4", "blocks.5"]:
            break
    assert _kept(model) == ["blocks.3", "blocks.4", "blocks.5"]
    assert most_device_bytes[0] <= budget, f"{most_device_bytes[0] / block:.1f} blocks under a 5-block budget"
    assert carried == []  # into the pass that took the new layout


def test_auto_budget_keeps_what_the_spare_memory_holds(monkeypatch):
    model = mlp_of_blocks(n_blocks=6)
    total = sum(device_layout_bytes(b) for b in model.blocks)
    monkeypatch.setattr(_timed, "spare_device_bytes", lambda device: total + 2**30)
    reference = reference_then_offload(model, "cpu", policy=offtensor.Policy(vram_budget="auto"))
    assert _kept(model) == []  # streams until the measured step sizes the budget
    _train(model, reference, steps=4)
    assert_params_match(model, reference, rtol=0, atol=0)
    assert_grads_match(model, reference, rtol=0, atol=0)
    assert len(_kept(model)) == 6


def test_auto_budget_without_device_memory_to_size_keeps_streaming():
    model = mlp_of_blocks(n_blocks=4)
    reference = reference_then_offload(model, "cpu", policy=offtensor.Policy(vram_budget="auto"))
    _train(model, reference, steps=4)
    assert_params_match(model, reference, rtol=0, atol=0)
    assert _kept(model) == []


def test_a_pass_that_raises_while_measured_is_measured_again(monkeypatch):
    model = mlp_of_blocks(n_blocks=4)
    budget = 4 * device_layout_bytes(model.blocks[0])
    reference = reference_then_offload(model, "cpu", policy=offtensor.Policy(vram_budget=budget, layout="timed"))
    x = torch.randn(4, 8)
    with torch.no_grad():
        model(x)
        handle = model.blocks[2].register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            model(x)  # the measured pass fails
        handle.remove()
        model(x)
        assert offtensor.summary(model).layout.predicted_forward_ms is None
        model(x)
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert offtensor.summary(model).layout.predicted_forward_ms is not None


def test_error_for_an_unknown_layout():
    with pytest.raises(ValueError, match="layout must be 'auto', 'timed' or 'spread', got 'fast'"):
        offtensor.Policy(vram_budget=2**30, layout="fast")
    with pytest.raises(ValueError, match=r"vram_budget must be a positive number of bytes .*, 'auto' or None"):
        offtensor.Policy(vram_budget="half")
