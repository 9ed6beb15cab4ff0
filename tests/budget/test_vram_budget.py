"""Policy(layout="spread", vram_budget=...): the first scope and others spread evenly over the order (by bytes)
stay resident, within what streaming leaves of the budget; the rest stream.

Checked against the unwrapped model (outputs, grads, several optimizer steps), with the loads
counted and the scopes' device bytes bounded by the budget at every load.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    device_layout_bytes,
    devices,
    mlp_of_blocks,
    random_batch,
    reference_then_offload,
    split_policy,
    tolerances,
)

import offtensor

N_BLOCKS = 8


def _block_bytes(model) -> int:
    return device_layout_bytes(model.blocks[0])


def _budget(model, kept: int, prefetch: int = 1) -> int:
    return (2 + prefetch + kept) * _block_bytes(model)


def _loads(model) -> dict[str, int]:
    return {s.name: s.loads for s in offtensor.summary(model).scopes}


def _three_kept_of_eight(device: str, checkpoint: str | None):
    """The block MLP wrapped with a spread budget that keeps 3 of its 8 blocks (0, 4, 7), its
    unwrapped reference, and the budget."""
    model = mlp_of_blocks(n_blocks=N_BLOCKS)
    model.checkpoint = checkpoint
    budget = _budget(model, kept=3)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    reference.checkpoint = checkpoint
    return model, reference, budget


def _kept_blocks(model) -> list[int]:
    """The indices of the blocks the budget keeps, as `offtensor.summary` shows them."""
    return [int(s.name.split(".")[1]) for s in offtensor.summary(model).scopes if s.kept]


def test_the_plan_keeps_the_first_scope_and_spreads_the_rest_and_summary_shows_it():
    model = mlp_of_blocks(n_blocks=N_BLOCKS)
    budget = _budget(model, kept=3)
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(layout="spread", vram_budget=budget))
    assert _kept_blocks(model) == [0, 4, 7]  # the first, then 2 spread over the other 7
    assert "offloaded (kept)" in str(offtensor.summary(model))


@pytest.mark.every_case
@pytest.mark.parametrize(("n_blocks", "kept", "expected"), [
    (8, 4, [0, 3, 5, 7]),
    (6, 2, [0, 5]),
    (8, 1, [0]),
    (48, 7, [0, 8, 16, 24, 32, 40, 47]),
])
def test_equal_blocks_keep_the_first_and_the_rest_evenly_spaced(n_blocks, kept, expected):
    """The first block (the one whose copy nothing hides) and then every (rest / kept rest)-th
    of the others, ending at the last: a streamed run never outlasts what a kept block's compute
    lets the copies catch up on (Note [kept scopes spread] in budget/vram.py). Fewer than half kept,
    no two are adjacent."""
    model = mlp_of_blocks(n_blocks=n_blocks)
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(layout="spread", vram_budget=_budget(model, kept=kept)))
    got = _kept_blocks(model)
    assert got == expected
    if 2 * len(got) < n_blocks:
        assert all(b - a > 1 for a, b in zip(got, got[1:], strict=False)), got


def test_a_first_scope_larger_than_the_room_does_not_stop_the_others_being_kept():
    """A first scope too large for what the budget leaves beside streaming (a wrapped
    embedding) streams; the smaller scopes after it are still kept, spread evenly."""
    model = _Linears([(16, 256)] + [(16, 16)] * 60)  # the first: 16 times the bytes of each other
    small = device_layout_bytes(model.layers[1])
    largest = device_layout_bytes(model.layers[0])
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(layout="spread", vram_budget=3 * largest + 3 * small))
    kept = [s.name for s in offtensor.summary(model).scopes if s.kept]
    assert "layers.0" not in kept and len(kept) == 3, kept


class _Linears(torch.nn.Module):
    """Linear layers of the given sizes, each a scope (the plan needs no forward)."""

    def __init__(self, sizes: list[tuple[int, int]]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(i, o) for i, o in sizes)


def _unequal_scopes(case: str) -> tuple[torch.nn.Module, offtensor.Policy, int, int]:
    """A model whose scopes differ in size, its policy without a budget, the largest block and
    the scopes' bytes."""
    if case == "split_blocks":  # each block splits into norm, fc1, fc2: 512, 2304, 2304 bytes
        model = mlp_of_blocks(n_blocks=8)
        return model, split_policy(model), _block_bytes(model), N_BLOCKS * _block_bytes(model)
    g = torch.Generator().manual_seed(0)
    widths = [int(w) for w in torch.randint(4, 48, (20,), generator=g)]
    sizes = [(16, w) for w in widths] if case == "random" else [(16, 64 if i % 3 == 2 else 16) for i in range(15)]
    model = _Linears(sizes)
    layers = [device_layout_bytes(m) for m in model.layers]
    return model, offtensor.Policy(), max(layers), sum(layers)


@pytest.mark.every_case
@pytest.mark.parametrize("fraction", [0.15, 0.3, 0.45])
@pytest.mark.parametrize("case", ["split_blocks", "two_sizes", "random"])
def test_unequal_scopes_are_kept_evenly_by_bytes_within_the_room(case, fraction):
    """Scopes of different sizes, with room to keep `fraction` of their bytes: the first is
    kept, and over every stretch of the rest from its start, the kept bytes follow the room's
    even share of the stretch's bytes, never above it and below it by less than the largest
    scope (Bresenham by bytes); the kept bytes never exceed the budget less the streaming room
    (3 blocks with prefetch 1). (Unlike equal blocks, two kept scopes may be adjacent: a small
    one kept right after a large one that is streamed.)"""
    model, policy, block, total_bytes = _unequal_scopes(case)
    streaming = 3 * block
    budget = streaming + int(fraction * total_bytes)
    offtensor.wrap(model, device="cpu", policy=dataclasses.replace(policy, layout="spread", vram_budget=budget))
    modules = dict(model.named_modules())
    rows = offtensor.summary(model).scopes
    sizes = [device_layout_bytes(modules[r.name]) for r in rows]
    kept = [r.kept for r in rows]
    assert kept[0]
    assert not all(kept)
    assert sum(s for s, k in zip(sizes, kept, strict=True) if k) <= budget - streaming
    share, total = budget - streaming - sizes[0], sum(sizes[1:])
    largest = max(sizes[1:])
    stretch = kept_bytes = 0
    for i in range(1, len(rows)):
        stretch += sizes[i]
        kept_bytes += sizes[i] if kept[i] else 0
        # kept_bytes / share vs stretch / total, in integers
        assert kept_bytes * total <= share * stretch, (i, kept)
        assert share * stretch - kept_bytes * total < largest * total, (i, kept)


def test_a_budget_that_holds_everything_keeps_every_scope():
    model = mlp_of_blocks(n_blocks=N_BLOCKS)
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(layout="spread", vram_budget=10 * 2**30))
    assert all(r.kept for r in offtensor.summary(model).scopes)


def test_a_budget_below_what_streaming_needs_says_what_it_needs():
    model = mlp_of_blocks(n_blocks=N_BLOCKS)
    need = 3 * _block_bytes(model)
    expected = (rf"Policy\(vram_budget=1000\) \(1000 bytes\) is below what streaming needs, "
                rf"{need / 1024:.1f} KiB: 3 times the largest selected module.*prefetch=1")
    with pytest.raises(ValueError, match=expected):
        offtensor.wrap(model, device="cpu", policy=offtensor.Policy(layout="spread", vram_budget=1000))
    assert not offtensor.is_wrapped(model)


@pytest.mark.parametrize("bad", [0, -5, 0.5, "1 gigabyte"])
def test_a_budget_that_is_not_a_positive_number_of_bytes_is_refused(bad):
    with pytest.raises(ValueError, match="vram_budget must be a positive number of bytes"):
        offtensor.Policy(layout="spread", vram_budget=bad)


@pytest.mark.parametrize("device", devices)
def test_inference_loads_kept_scopes_once_and_streams_the_rest(device, most_device_bytes):
    model = mlp_of_blocks(n_blocks=N_BLOCKS).eval()
    budget = _budget(model, kept=3)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    x = torch.randn(5, 8, device=device)
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(model(x), reference(x), **tolerances(device))
    kept = _kept_blocks(model)
    assert kept == [0, 4, 7]
    streamed = [i for i in range(N_BLOCKS) if i not in kept]
    loads = _loads(model)
    assert [loads[f"blocks.{i}"] for i in kept] == [1, 1, 1]
    # Blocks 1 and 2 once more: the last call's end loaded them for a next one, carried (Note
    # [carried into the next forward] in budget/vram.py); the next call would start on them.
    carried = [1, 2]
    assert all(loads[f"blocks.{i}"] == 4 + (i in carried) for i in streamed), loads
    states = {s.name: s.state for s in offtensor.summary(model).scopes}
    assert all(states[f"blocks.{i}"] is offtensor.ScopeState.RESIDENT for i in kept)
    assert all((states[f"blocks.{i}"] is offtensor.ScopeState.OFFLOADED) is (i not in carried) for i in streamed)
    assert [s.name for s in offtensor.summary(model).scopes if s.carried] == ["blocks.1", "blocks.2"]
    assert most_device_bytes[0] <= budget
    offtensor.unwrap(model)  # releases the kept scopes too; the masters come back as plain parameters
    with torch.no_grad():
        torch.testing.assert_close(model.to(device)(x), reference(x), **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_streamed_scopes_fill_the_streaming_room_while_kept_scopes_compute(device, most_device_bytes):
    """With prefetch 1 the streaming room holds 3 blocks. While a streamed block computes, it
    and the next 2 streamed blocks are on the device (the one before it was released as its
    forward ended); while a kept block computes, the whole room is free for the next 3 streamed
    ones, so the copies catch up there instead of waiting for the next streamed block to start
    (Note [the streaming room] in budget/vram.py). Kept blocks are skipped over: they are resident all along. 12 blocks
    with room for 3 kept: 0, 6 and 11, so a kept block computes in the middle of the pass too."""
    n_blocks = 12
    model = mlp_of_blocks(n_blocks=n_blocks).eval()
    budget = _budget(model, kept=3)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    kept = _kept_blocks(model)
    assert kept == [0, 6, 11]
    on_device: dict[int, list[int]] = {}

    def record(i):
        def hook(module, args):
            states = {s.name: s.state for s in offtensor.summary(model).scopes}
            on_device[i] = [j for j in range(n_blocks)
                            if states[f"blocks.{j}"] is not offtensor.ScopeState.OFFLOADED]
        return hook

    x = torch.randn(5, 8, device=device)
    with torch.no_grad():
        model(x)  # learns the order
        handles = [b.register_forward_pre_hook(record(i)) for i, b in enumerate(model.blocks)]
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))
    for h in handles:
        h.remove()

    def expected(i: int) -> list[int]:
        streamed_after = [j for j in range(i + 1, n_blocks) if j not in kept]
        computing = [] if i in kept else [i]
        ahead = streamed_after[:3 - len(computing)]
        if ahead == streamed_after:  # the pass's own copies are done: the next call's first
            # streamed blocks follow, carried, in the room less one block (Note [carried into
            # the next forward] in budget/vram.py)
            ahead += [1, 2][:min(2, 3 - len(computing) - len(ahead))]
        return sorted(kept + computing + ahead)

    assert on_device[0] == [0, 1, 2, 3, 6, 11]  # kept 0 computes: 1, 2, 3 fill the room
    assert on_device[5] == [0, 5, 6, 7, 8, 11]  # 5 computes, 7 and 8 ahead (past kept 6)
    assert on_device[6] == [0, 6, 7, 8, 9, 11]  # kept 6 computes: 7, 8, 9 fill the room
    assert on_device[9] == [0, 1, 6, 9, 10, 11]  # 10 is the last to load: block 1 follows, for the next call
    assert on_device[10] == [0, 1, 2, 6, 10, 11]
    assert on_device == {i: expected(i) for i in range(n_blocks)}
    assert most_device_bytes[0] <= budget


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
@pytest.mark.parametrize("device", devices)
def test_training_with_a_budget_matches_the_unwrapped_model(device, overlapped, checkpoint, most_device_bytes):
    """Kept trainable scopes load once per step (an optimizer step, maybe deferred on the
    worker, changes their masters: they are reloaded, never used stale)."""
    model, reference, budget = _three_kept_of_eight(device, checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    per_step = []
    for _ in range(4):
        before = _loads(model)
        for micro in range(2):  # accumulation
            x, y = random_batch(device)
            loss, ref_loss = F.mse_loss(model(x), y), F.mse_loss(reference(x), y)
            if overlapped and micro == 1:
                offtensor.backward_and_step(loss, opt, zero_grad=True)
            else:
                loss.backward()
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss, **tolerances(device))
        if not overlapped:
            opt.step()
            opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        after = _loads(model)
        per_step.append({n: after[n] - before[n] for n in after})
    offtensor.wait_for_steps()
    assert_params_match(model, reference, **tolerances(device))
    kept = _kept_blocks(model)
    assert kept == [0, 4, 7]
    for counts in per_step[1:]:
        assert [counts[f"blocks.{i}"] for i in kept] == [1, 1, 1], counts  # once per step
        # A streamed block loads in each forward and each backward, 4 times a step; 3 for those
        # the first micro-batch's backward leaves resident for the second's forward (1 and 2
        # here, Note [carried into the next forward] in budget/vram.py).
        assert all(counts[f"blocks.{i}"] >= 2 for i in range(N_BLOCKS) if i not in kept), counts
    assert most_device_bytes[0] <= budget
    assert_all_scopes_offloaded(model)  # kept ones, if resident, equal their masters


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
@pytest.mark.parametrize("device", devices)
def test_a_kept_scope_stepped_but_still_fenced_when_its_next_forward_starts_loads_once(device, checkpoint):
    """Regression (the CUDA suite under 12 workers: a kept block loaded twice in a step): the
    next forward reached a kept scope whose masters the worker had just updated, its fences not
    yet cleared. The load still held those copies back, as it should, but the check for writes
    since the last copy compared the updated masters with the versions of the previous step's
    copies, found them written, and released and reloaded the scope (Note [a load held back for
    its steps] in engine/writes.py). Here that moment is held open for block 0 (kept; its
    gradients come last, so the worker steps it last): after updating it the worker waits, in a
    step post-hook (which runs before the fences clear), until block 0's next forward has begun,
    and that forward first waits until the worker has updated it."""
    import threading

    model, reference, _ = _three_kept_of_eight(device, checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    held = {id(p) for p in model.blocks[0].parameters()}
    updated, began = threading.Event(), threading.Event()
    timed_out = []

    def hold_the_fences(optimizer, args, kwargs):
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if threading.current_thread() is not threading.main_thread() and stepped & held and not updated.is_set():
            updated.set()
            timed_out.append(not began.wait(timeout=20))

    def forward_outside_backward() -> bool:  # not a checkpoint's recompute
        return stepping and torch._C._current_graph_task_id() == -1

    def until_updated(module, args):
        if forward_outside_backward():
            timed_out.append(not updated.wait(timeout=20))

    def has_begun(module, args):
        if forward_outside_backward():
            began.set()

    opt.register_step_post_hook(hold_the_fences)
    model.blocks[0].register_forward_pre_hook(until_updated, prepend=True)  # before offtensor's
    model.blocks[0].register_forward_pre_hook(has_begun)  # after offtensor's
    stepping = False  # no step before the first forward
    per_step = []
    for _ in range(4):
        before = _loads(model)
        x, y = random_batch(device)
        loss, ref_loss = F.mse_loss(model(x), y), F.mse_loss(reference(x), y)
        updated.clear(), began.clear()  # this forward used every block: the last step's pieces are done
        stepping = True
        offtensor.backward_and_step(loss, opt, zero_grad=True)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, **tolerances(device))
        per_step.append({n: after - before[n] for n, after in _loads(model).items()})
    began.set()
    offtensor.wait_for_steps()
    # Each of the 4 steps' worker waited once, each of the 3 forwards after a step once.
    assert timed_out == [False] * 7, f"the worker or the forward did not come: {timed_out}"
    assert_params_match(model, reference, **tolerances(device))
    kept = _kept_blocks(model)
    assert kept == [0, 4, 7]
    for counts in per_step[1:]:
        assert [counts[f"blocks.{i}"] for i in kept] == [1, 1, 1], counts


@pytest.mark.parametrize("device", devices)
def test_the_first_backward_of_split_blocks_under_reentrant_checkpointing_stays_within_the_budget(
        device, most_device_bytes):
    """Before any backward its order is guessed as the reverse forward order, but reentrant
    checkpointing recomputes a split block from its first scope: the streaming room filled with
    the blocks below, and the block's other scopes then loaded on demand on top of it (blocks.5.fc1
    at 5/3 of the room). A scope backward needs now displaces prefetches not needed yet."""
    model = mlp_of_blocks(n_blocks=6, checkpoint="reentrant")
    budget = _budget(model, kept=1)
    policy = dataclasses.replace(split_policy(model), layout="spread", vram_budget=budget)
    reference = reference_then_offload(model, device, policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(2):
        x, y = random_batch(device)
        F.mse_loss(model(x), y).backward()
        F.mse_loss(reference(x), y).backward()
        assert_grads_match(model, reference, **tolerances(device))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_params_match(model, reference, **tolerances(device))
    assert most_device_bytes[0] <= budget
    assert_all_scopes_offloaded(model)


WRITES_BYPASSING_THE_PARAMETER = {
    "data_add": lambda p: p.data.add_(1.0),
    "data_copy": lambda p: p.data.copy_(torch.full_like(p.data, 0.5)),  # what set .data's error suggests
    "view_fill": lambda p: p[0].fill_(3.0),  # an embedding's padding row
    "detach_mul": lambda p: p.detach().mul_(-2.0),
}


@pytest.mark.parametrize("write", list(WRITES_BYPASSING_THE_PARAMETER))
@pytest.mark.parametrize("device", devices)
def test_a_write_that_bypasses_the_parameter_reloads_a_kept_scope(device, write):
    """A kept scope stays resident between forwards, so a write to its master that no op on the
    parameter sees (through `p.data`, a view, a detached alias) left the next forward computing
    with the old weights: a silent wrong answer that streaming (a fresh load per forward) hides."""
    model = mlp_of_blocks(n_blocks=N_BLOCKS).eval()
    reference = reference_then_offload(
        model, device, policy=offtensor.Policy(layout="spread", vram_budget=_budget(model, kept=3)))
    kept = _kept_blocks(model)
    written = kept[1]  # a kept block other than the first (0, 4, 7 kept here: block 4)
    x = torch.randn(5, 8, device=device)
    with torch.no_grad():
        model(x)
        for m in (model, reference):
            WRITES_BYPASSING_THE_PARAMETER[write](m.blocks[written].fc1.weight)
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))
    loads = _loads(model)
    assert loads[f"blocks.{written}"] == 2  # reloaded once, after the write
    assert all(loads[f"blocks.{i}"] == 1 for i in kept if i != written), loads  # only the written scope reloads
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_frozen_kept_scopes_stay_resident_across_training_steps(device):
    """A LoRA-style frozen base: no optimizer step changes the kept masters, so they never
    reload."""
    model = mlp_of_blocks(n_blocks=N_BLOCKS)
    for block in model.blocks:
        block.requires_grad_(False)
    budget = _budget(model, kept=3)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        x, y = random_batch(device)
        F.mse_loss(model(x), y).backward()
        F.mse_loss(reference(x), y).backward()
        assert_grads_match(model, reference, **tolerances(device))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    kept = _kept_blocks(model)
    assert kept == [0, 4, 7]
    loads = _loads(model)
    assert [loads[f"blocks.{i}"] for i in kept] == [1, 1, 1]
    assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("taken", ["before_the_first_forward", "after_the_first_forward"])
@pytest.mark.parametrize("device", devices)
def test_a_write_through_a_data_alias_kept_across_forwards_reloads_a_kept_scope(device, taken):
    """`p.data` has a version counter of its own: taking it released a kept copy at once, but
    a write through it after the next load left the kept copy stale for every later forward."""
    model = mlp_of_blocks(n_blocks=N_BLOCKS).eval()
    reference = reference_then_offload(
        model, device, policy=offtensor.Policy(layout="spread", vram_budget=_budget(model, kept=3)))
    written = _kept_blocks(model)[1]
    x = torch.randn(5, 8, device=device)
    with torch.no_grad():
        if taken == "after_the_first_forward":
            model(x)
        aliases = [m.blocks[written].fc1.weight.data for m in (model, reference)]
        model(x)
        for _ in range(2):
            for a in aliases:
                a.mul_(-2.0)
            torch.testing.assert_close(model(x), reference(x), **tolerances(device))
            torch.testing.assert_close(model(x), reference(x), **tolerances(device))
    loads = _loads(model)
    assert loads[f"blocks.{written}"] == (3 if taken == "before_the_first_forward" else 4), loads


@pytest.mark.parametrize("device", devices)
def test_a_write_to_a_kept_master_reloads_it(device):
    model = mlp_of_blocks(n_blocks=N_BLOCKS).eval()
    reference = reference_then_offload(
        model, device, policy=offtensor.Policy(layout="spread", vram_budget=_budget(model, kept=3)))
    x = torch.randn(5, 8, device=device)
    with torch.no_grad():
        model(x)
        for m in (model, reference):
            m.blocks[0].fc1.weight.mul_(-2.0)
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))
    assert _loads(model)["blocks.0"] == 2


@pytest.mark.parametrize("device", devices)
def test_an_exception_in_forward_releases_the_streamed_scopes_and_keeps_the_kept(device):
    model = mlp_of_blocks(n_blocks=N_BLOCKS)
    reference = reference_then_offload(
        model, device, policy=offtensor.Policy(layout="spread", vram_budget=_budget(model, kept=3)))

    def boom(module, args):
        raise RuntimeError("boom")

    kept = _kept_blocks(model)
    assert kept == [0, 4, 7]
    handle = model.blocks[5].register_forward_pre_hook(boom)  # streamed, after kept 4 computed
    x, y = random_batch(device)
    with pytest.raises(RuntimeError, match="boom"):
        model(x)
    handle.remove()
    states = {s.name: s.state for s in offtensor.summary(model).scopes}
    assert all(states[f"blocks.{i}"] is offtensor.ScopeState.OFFLOADED for i in range(N_BLOCKS) if i not in kept)
    assert states["blocks.0"] is states["blocks.4"] is offtensor.ScopeState.RESIDENT  # the kept it reached
    assert_all_scopes_offloaded(model)  # the kept ones equal their masters
    F.mse_loss(model(x), y).backward()
    F.mse_loss(reference(x), y).backward()
    assert_grads_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("first", ["raised", "shorter"])
def test_a_pass_past_the_learned_order_leaves_its_blocks_to_stream(device, first):
    """The first forward raised midway (an out-of-memory a batch-size finder catches) or ran fewer
    blocks: the next training forward runs past the learned order's end. Each block it appends
    was once the order's end, kept for a backward starting with it: the whole tail stayed on the
    device, whatever the budget (Note [the last scope of an extended order])."""
    model = mlp_of_blocks(n_blocks=N_BLOCKS)
    budget = _budget(model, kept=0)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(vram_budget=budget))
    x, y = random_batch(device)
    if first == "raised":
        handle = model.blocks[2].register_forward_pre_hook(lambda module, args: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            model(x)
        handle.remove()
    else:
        for m in (model, reference):
            blocks = m.blocks
            m.blocks = torch.nn.ModuleList(list(blocks)[:2])
            F.mse_loss(m(x), y).backward()
            m.blocks = blocks
    loss = F.mse_loss(model(x), y)
    held = sum(s.device_bytes for s in offtensor.summary(model).scopes)
    assert held <= _block_bytes(model), f"{held / _block_bytes(model):.0f} blocks held for the backward"
    loss.backward()
    F.mse_loss(reference(x), y).backward()
    assert_grads_match(model, reference, **tolerances(device))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_peak_device_memory_of_the_weights_stays_within_the_budget():
    """Peak CUDA memory of an inference pass with a budget: the kept and streamed weights stay
    within the budget (activations, tiny here, get a small allowance)."""
    model = mlp_of_blocks(n_blocks=N_BLOCKS, hidden=512).eval()
    budget = _budget(model, kept=2)
    offtensor.wrap(model, device="cuda", policy=offtensor.Policy(layout="spread", vram_budget=budget))
    model.input.to("cuda")
    model.head.to("cuda")
    x = torch.randn(4, 8, device="cuda")
    with torch.no_grad():
        model(x)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
    kept_bytes = 2 * _block_bytes(model)
    assert base >= kept_bytes  # the kept scopes stay between passes
    assert torch.cuda.max_memory_allocated() - base <= budget - kept_bytes + 2**20


@pytest.mark.parametrize("device", devices)
def test_a_frozen_parameter_with_an_old_grad_leaves_no_gradient_on_a_kept_scope(device, most_device_bytes):
    """A parameter frozen after training keeps its (zeroed) `.grad`; the backward that adds to
    the other gradients fetched that one to the device too, and no gradient came to take it: a
    kept scope held it from then on, beyond the budget, until a write to its masters."""
    model = mlp_of_blocks(n_blocks=N_BLOCKS)
    budget = _budget(model, kept=1)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    assert _kept_blocks(model) == [0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        if step == 1:  # frozen with a zeroed .grad (zero_grad(set_to_none=False)): kept, unused
            for m in (model, reference):
                m.blocks[0].fc1.weight.requires_grad_(False)
                m.blocks[3].fc1.weight.requires_grad_(False)
        x, y = random_batch(device)
        F.mse_loss(model(x), y).backward()
        F.mse_loss(reference(x), y).backward()
        assert_grads_match(model, reference, **tolerances(device))
        assert_all_scopes_offloaded(model)  # the kept scope holds its weights, no gradient
        opt.step(), ref_opt.step()
        opt.zero_grad(set_to_none=False), ref_opt.zero_grad(set_to_none=False)
    assert_params_match(model, reference, **tolerances(device))
    assert most_device_bytes[0] <= budget
