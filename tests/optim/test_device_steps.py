"""`backward_and_step(device_share=f)` steps some pieces on the device and matches the unwrapped
model (Note [device steps] in optim/device_steps.py).

On the CPU the "device" is the CPU: the same copies in and out, the same step on the copies,
the same fences, so CI covers the mechanism; results are bit-identical there. Which pieces go
to the device depends on timing (two ready at once), so most tests let the device take a piece
whenever it has room (`DEVICE_MIN_READY = 1`); one test checks the choice itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    BlockStack,
    ResidualBlock,
    assert_all_scopes_offloaded,
    assert_params_match,
    devices,
    mlp_of_blocks,
    offload,
    reference_then_offload,
    requires_cuda,
    tolerances,
)

import offtensor

_O = torch.optim
OPTIMIZERS = {
    "adamw_fused": lambda ps: _O.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_single_tensor": lambda ps: _O.AdamW(ps, lr=1e-2, foreach=False),
    "adam_amsgrad_foreach": lambda ps: _O.Adam(ps, lr=1e-2, amsgrad=True, foreach=True),
    "sgd_momentum_nesterov": lambda ps: _O.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
    "sgd_plain": lambda ps: _O.SGD(ps, lr=1e-2),
}


@pytest.fixture
def device_takes_any(monkeypatch):
    """The device takes a ready piece whenever it has room, not only while two are ready."""
    monkeypatch.setattr("offtensor.optim.device_steps.DEVICE_MIN_READY", 1)


def _batches(device, n=5):
    return [(torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)) for _ in range(n)]


def _state_on_host(opt, model):
    """Every offloaded parameter's state is on the host; on CUDA some of it page-locked (homes
    of the state of device steps)."""
    pinned, on_cuda = [], False
    for p in model.parameters():
        if not isinstance(p, offtensor.OffloadedParameter):
            continue
        on_cuda = p._ot.scope.engine.device.type == "cuda"
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.device.type == "cpu", (key, value.device)
                pinned.append(value.is_pinned())
    if pinned and on_cuda:
        assert any(pinned)


@pytest.mark.every_case
@pytest.mark.usefixtures("device_takes_any")
@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("share", [0.3, 1.0])
@pytest.mark.parametrize("checkpoint", [None, "non-reentrant"])
def test_device_steps_train_like_unwrapped(device, optimizer, share, checkpoint):
    """Five overlapped steps with part (or all) of the model stepped on the device, the
    optimizer's state compared too; the parameters are read right after the last call, while
    its device steps may still be in flight (their fences make the reads wait)."""
    model = mlp_of_blocks(n_blocks=4, checkpoint=checkpoint)
    reference = reference_then_offload(model, device)
    ref_opt, opt = OPTIMIZERS[optimizer](reference.parameters()), OPTIMIZERS[optimizer](model.parameters())
    for x, y in _batches(device):
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        report = offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True, device_share=share)
    assert_params_match(model, reference, **tolerances(device))
    report.wait()
    assert report.device_pieces > 0 and report.device_steps_off == ""
    if share < 1:  # the device's bytes ran out: the host stepped the rest
        assert report.device_pieces < report.pieces
    _state_on_host(opt, model)
    ref_state, state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    assert ref_state.keys() == state.keys()
    for i in ref_state:
        for key in ref_state[i]:
            torch.testing.assert_close(state[i][key].cpu(), ref_state[i][key].cpu(), **tolerances(device))
    assert_all_scopes_offloaded(model)


@pytest.mark.usefixtures("device_takes_any")
@pytest.mark.parametrize("device", devices)
def test_the_share_can_change_between_steps_and_the_state_carries_over(device):
    """Host steps, then all on the device, then part, then host again, with a fresh optimizer
    loading the state dict in the middle: the state moves between the host's and the device's
    steps without a break."""
    model = mlp_of_blocks(n_blocks=3)
    reference = reference_then_offload(model, device)
    ref_opt = _O.AdamW(reference.parameters(), lr=1e-2, fused=True)
    opt = _O.AdamW(model.parameters(), lr=1e-2, fused=True)
    for i, (x, y) in enumerate(_batches(device, 6)):
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True,
                                    device_share=[0.0, 1.0, 0.5, 1.0, 0.0, 0.5][i])
        if i == 2:
            fresh = _O.AdamW(model.parameters(), lr=1e-2, fused=True)
            fresh.load_state_dict(opt.state_dict())
            opt = fresh
    offtensor.wait_for_steps()
    assert_params_match(model, reference, **tolerances(device))
    _state_on_host(opt, model)


@pytest.mark.usefixtures("device_takes_any")
@pytest.mark.parametrize("device", devices)
def test_device_steps_keep_gradients_without_zero_grad_and_follow_lr_changes(device):
    """zero_grad=False: each stepped parameter's `.grad` is its host gradient, as after
    optimizer.step(); an LR scheduler's change after the call applies from the next step."""
    model = mlp_of_blocks(n_blocks=3)
    reference = reference_then_offload(model, device)
    ref_opt, opt = _O.Adam(reference.parameters(), lr=1e-2), _O.Adam(model.parameters(), lr=1e-2)
    ref_sched, sched = _O.lr_scheduler.StepLR(ref_opt, 1, 0.5), _O.lr_scheduler.StepLR(opt, 1, 0.5)
    for x, y in _batches(device, 3):
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_sched.step()
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt, device_share=1.0)
        sched.step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert p.grad.device.type == "cpu" if isinstance(p, offtensor.OffloadedParameter) else True, name
            torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), **tolerances(device), msg=name)
        ref_opt.zero_grad()
        opt.zero_grad()
    assert_params_match(model, reference, **tolerances(device))


class _OwnAdamW(torch.optim.AdamW):
    """An optimizer class of the user's: its steps stay on the host."""


@pytest.mark.usefixtures("device_takes_any")
@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("why", ["own class", "step hook", "tensor lr"])
def test_optimizers_that_cannot_step_on_the_device_step_on_the_host_and_say_why(device, why):
    model = mlp_of_blocks(n_blocks=2)
    reference = reference_then_offload(model, device)
    make = {"own class": lambda ps: _OwnAdamW(ps, lr=1e-2),
            "step hook": lambda ps: _O.AdamW(ps, lr=1e-2),
            "tensor lr": lambda ps: _O.AdamW(ps, lr=torch.tensor(1e-2), foreach=False)}[why]
    ref_opt, opt = make(reference.parameters()), make(model.parameters())
    seen = []
    if why == "step hook":
        opt.register_step_post_hook(lambda o, *_: seen.append(o.param_groups[0]["params"][0]))
    for x, y in _batches(device, 2):
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        report = offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True, device_share=1.0)
    report.wait()
    assert report.device_pieces == 0
    expected = {"own class": "_OwnAdamW is not SGD, Adam or AdamW", "step hook": "step hooks of the user's",
                "tensor lr": "a param group's 'lr' is a tensor"}[why]
    assert expected in report.device_steps_off
    assert all(p is q for p, q in zip(seen, seen, strict=True))
    if why == "step hook":  # the hook saw the parameters themselves, never device copies
        params = {id(p) for p in model.parameters()}
        assert seen and all(id(p) in params for p in seen)
    assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("share", [-0.1, 1.5, True, "half"])
def test_error_if_device_share_is_not_a_fraction(share):
    model = offload(mlp_of_blocks(n_blocks=1), "cpu")
    opt = _O.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(2, 8)).sum()
    with pytest.raises(ValueError, match=r"device_share must be a number from 0 to 1, got"):
        offtensor.backward_and_step(loss, opt, device_share=share)


def test_error_if_device_share_is_given_with_a_vram_budget():
    model = offload(mlp_of_blocks(n_blocks=2), "cpu", policy=offtensor.Policy(vram_budget=2**20))
    opt = _O.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(2, 8)).sum()
    with pytest.raises(ValueError, match=r"device_share=0.5 steps parts of the model on the device.*VRAM budget"):
        offtensor.backward_and_step(loss, opt, device_share=0.5)
    offtensor.backward_and_step(loss, opt, device_share=0.0)  # and without it, the step goes on


@pytest.mark.usefixtures("device_takes_any")
@pytest.mark.parametrize("device", devices)
def test_a_failing_device_step_is_a_partial_step_and_leaves_no_fence(device, monkeypatch):
    """The device step of the second piece raises: the error comes out of the next wait, naming
    what was stepped, and no parameter is left waiting on a fence."""
    import offtensor.optim.device_steps as device_steps

    model = offload(mlp_of_blocks(n_blocks=3), device)
    opt = _O.AdamW(model.parameters(), lr=1e-2)
    x, y = _batches(device, 1)[0]
    offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True, device_share=1.0)
    offtensor.wait_for_steps()
    real, calls = device_steps.step_on_device, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("no room for the piece")
        return real(*args)

    monkeypatch.setattr(device_steps, "step_on_device", failing)
    with pytest.raises(MemoryError, match="no room") as info:
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True, device_share=1.0,
                                    piece_bytes=4096)
        offtensor.wait_for_steps()
    assert "stepped" in str(info.value.__notes__ if hasattr(info.value, "__notes__") else info.value)
    assert not any(p._ot.step_pending for p in model.parameters() if isinstance(p, offtensor.OffloadedParameter))
    monkeypatch.setattr(device_steps, "step_on_device", real)
    offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True, device_share=1.0)
    offtensor.wait_for_steps()
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_the_device_takes_the_pieces_the_next_forward_needs_last_and_the_host_the_first(device, monkeypatch):
    """The worker is held on the first piece (a post-accumulate-grad hook of the last block's
    weight, which lands first) until backward has handed over every piece; then, with several
    ready, the device gets the later scopes and the host keeps the first one of the forward."""
    import threading

    import offtensor.optim.views as views

    model = offload(mlp_of_blocks(n_blocks=4), device)
    opt = _O.AdamW(model.parameters(), lr=1e-2)
    x, y = _batches(device, 1)[0]
    offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True)  # learn the order
    offtensor.wait_for_steps()
    where: list[tuple[str, str]] = []
    real = views.step_subset

    def spy(optimizer, ids, *args, substitute=None, **kwargs):
        names = [n for n, p in model.named_parameters() if id(p) in ids]
        if isinstance(dict(model.named_parameters())[names[0]], offtensor.OffloadedParameter):
            where.append(("device" if substitute is not None else "host", names[0]))
        return real(optimizer, ids, *args, substitute=substitute, **kwargs)

    monkeypatch.setattr(views, "step_subset", spy)
    release = threading.Event()
    handle = model.blocks[3].fc2.weight.register_post_accumulate_grad_hook(lambda p: release.wait(30))
    loss = F.mse_loss(model(x), y)
    report = offtensor.backward_and_step(loss, opt, zero_grad=True, device_share=1.0)
    release.set()
    report.wait()
    handle.remove()
    order = [n for n, _ in model.named_parameters()]
    assert where[0][1] == "blocks.3.norm.weight", where  # the held piece (the device's, if 2 were ready)
    after = where[1:]
    assert [w for w, _ in after].count("device") >= 1, where
    first = min(after, key=lambda e: order.index(e[1]))
    assert first == ("host", "blocks.0.norm.weight"), where  # what the next forward needs first
    device_first = min(order.index(n) for w, n in after if w == "device")
    assert all(order.index(n) < device_first for w, n in after if w == "host"), where
    assert_all_scopes_offloaded(model)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.usefixtures("device_takes_any")
def test_device_steps_stay_within_their_pieces_in_flight_on_the_device():
    """Peak device memory of an overlapped step with every piece stepped on the device exceeds
    the host-stepped one by at most DEVICE_PIECES_IN_FLIGHT pieces' copies (master, gradient,
    two AdamW moments: 4 x piece_bytes each, plus the allocator's rounding)."""
    from offtensor.optim.device_steps import DEVICE_PIECES_IN_FLIGHT

    piece = 2**20
    model = offload(mlp_of_blocks(n_blocks=8, hidden=512), "cuda")
    opt = _O.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = torch.randn(64, 8, device="cuda"), torch.randn(64, 4, device="cuda")

    def peak(share):
        offtensor.wait_for_steps()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True, piece_bytes=piece,
                                    device_share=share)
        offtensor.wait_for_steps()
        return torch.cuda.max_memory_allocated() - base

    for share in (0.0, 1.0):
        peak(share)  # the optimizer's state exists after the first step of each kind
    host, on_device = peak(0.0), peak(1.0)
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    allowed = DEVICE_PIECES_IN_FLIGHT * 4 * max(piece, block_bytes) + 2**20
    assert on_device - host <= allowed, (host, on_device, allowed)
    assert_all_scopes_offloaded(model)


@pytest.mark.usefixtures("device_takes_any")
@pytest.mark.parametrize("device", devices)
def test_the_device_takes_no_piece_over_twice_piece_bytes(device, monkeypatch):
    """A piece of one large parameter (an embedding, a head) stays on the host: its copies would
    take four times its size on the device (Note [device steps])."""
    import offtensor.optim.device_steps as device_steps

    model = mlp_of_blocks(n_blocks=3)
    reference = reference_then_offload(model, device)
    ref_opt, opt = _O.AdamW(reference.parameters(), lr=1e-2), _O.AdamW(model.parameters(), lr=1e-2)
    sizes, real = [], device_steps.step_on_device

    def spy(slots, *args):
        sizes.append(sum(s.param.numel() * s.param.element_size() for s in slots))
        return real(slots, *args)

    monkeypatch.setattr(device_steps, "step_on_device", spy)
    piece = 512  # pieces with an fc1/fc2 weight (2048 bytes) are over twice this
    for x, y in _batches(device, 2):
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        report = offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True, piece_bytes=piece,
                                             device_share=1.0)
    report.wait()
    assert sizes and max(sizes) <= 2 * piece, sizes
    assert report.device_pieces < report.pieces
    assert_params_match(model, reference, **tolerances(device))


class _SparseEmbedding(torch.nn.Module):
    """A scope whose one parameter gets a sparse gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(24, 16, sparse=True)

    def forward(self, tokens):
        return self.embed(tokens)


@pytest.mark.usefixtures("device_takes_any")
@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["sgd_plain", "sgd_momentum"])
def test_a_piece_with_a_sparse_gradient_steps_on_the_host(device, momentum, monkeypatch):
    """Regression: the device took the piece of an Embedding(sparse=True), whose gradient its
    dense copies cannot hold, and raised "copy_() between dense and sparse Tensors" after the
    later blocks were stepped (a partial step). That piece stays on the host; the others still
    go to the device, and five steps match the unwrapped model's."""
    import offtensor.optim.device_steps as device_steps

    model = BlockStack([_SparseEmbedding(), ResidualBlock(16), ResidualBlock(16)], 8, 16, 3)
    model.input = torch.nn.Identity()  # the embedding takes the tokens
    reference = reference_then_offload(model, device)
    make = lambda ps: _O.SGD(ps, lr=0.1, momentum=momentum)
    ref_opt, opt = make(reference.parameters()), make(model.parameters())
    on_device, real = [], device_steps.step_on_device

    def spy(slots, *args):
        on_device.extend(s.name for s in slots)
        return real(slots, *args)

    monkeypatch.setattr(device_steps, "step_on_device", spy)
    for _ in range(5):
        tokens = torch.randint(0, 24, (3, 5), device=device)
        reference(tokens).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        # 1536 embedding bytes: under twice piece_bytes, so only its sparse gradient keeps it on the host
        report = offtensor.backward_and_step(model(tokens).pow(2).mean(), opt, zero_grad=True,
                                             piece_bytes=1024, device_share=1.0)
        report.wait()
        assert report.device_pieces > 0
    assert on_device and "blocks.0.embed.weight" not in on_device, on_device
    assert_params_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)
