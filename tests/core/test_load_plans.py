"""A progressive load's plan (Note [load plans] in scopes/loading.py): chunks that cover the copy
order once and in order, the fewest copies per chunk, and on CUDA one dequantization kernel per
chunk of an fp8 load; the results are the unwrapped model's (or the resident compressed one's)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import BlockStack, ResidualBlock, devices, host, requires_cuda, tolerances
from torch import nn

import offtensor
from offtensor.engine.engine import find_engine as _find_engine
from offtensor.scopes import loading as loading_module
from offtensor.storage.compress import MIN_NUMEL, quantize_dequantize
from offtensor.storage.fp8 import FusedDequantization

HIDDEN = 64  # fc1 is 64 x 128: above MIN_NUMEL, compressible


def _model(dtype: torch.dtype, n_blocks: int = 3) -> BlockStack:
    torch.manual_seed(0)
    return BlockStack([ResidualBlock(HIDDEN) for _ in range(n_blocks)], 8, HIDDEN, 4).to(dtype)


def _plans(model: nn.Module) -> list[tuple[object, loading_module.LoadPlan]]:
    return [(scope, scope.load_plan) for scope in _find_engine(model).scopes if scope.load_plan is not None]


def _check_cover(scope, plan: loading_module.LoadPlan) -> None:
    """The chunks partition copy_order in order, each parameter knows its chunk, and each
    parameter's bytes are in exactly one copy of its chunk."""
    assert plan.order is scope.copy_order
    assert [s for chunk in plan.chunks for s in chunk.slots] == scope.copy_order
    assert [chunk.lo for chunk in plan.chunks] == [0, *[chunk.hi for chunk in plan.chunks[:-1]]]
    for c, chunk in enumerate(plan.chunks):
        converts = set(chunk.converts)
        for slot in chunk.slots:
            assert slot.chunk == c
            if slot in converts:
                runs = [(h, h + n) for h, n in chunk.staged]
                start, end = slot.offset, slot.offset + slot.host_nbytes
            else:
                runs = [(d, d + n) for h, d, n in chunk.direct if h - d == slot.offset - slot.device_offset]
                start, end = slot.device_offset, slot.device_offset + slot.device_view.nbytes
            assert sum(a <= start and end <= b for a, b in runs) == 1, slot.name


@pytest.mark.parametrize("chunk_bytes", [4096, 32 * 2**20], ids=["small-chunks", "one-chunk"])
@pytest.mark.parametrize("device", devices)
def test_plain_loads_copy_neighbours_as_one_run_and_match_the_unwrapped_model(device, chunk_bytes, monkeypatch):
    """A block's parameters lie in use order in both buffers: each chunk is one copy. Training
    over steps (plain SGD, whose steps rewrite the masters between loads) equals the unwrapped
    model's outputs and gradients."""
    monkeypatch.setattr(loading_module, "CHUNK_BYTES", chunk_bytes)
    model = _model(torch.float32)
    reference = copy.deepcopy(model).to(device)
    offtensor.wrap(model, device=device)
    model.to(device)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, reference))
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(5, 8, generator=gen).to(device)
        out, ref = model(x), reference(x)
        torch.testing.assert_close(out, ref, **tolerances(device))
        out.square().mean().backward()
        ref.square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(host(p.grad), host(q.grad), **tolerances(device), msg=name)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    plans = _plans(model)
    assert len(plans) == 3
    for scope, plan in plans:
        _check_cover(scope, plan)
        assert len(plan.chunks) == (3 if chunk_bytes == 4096 else 1)
        assert all(len(chunk.direct) == 1 and not chunk.staged for chunk in plan.chunks)


class Crossed(nn.Module):
    """Uses its parameters against their layout order: `b` before `a`, and `a`'s bias first."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.a.bias
        return self.a(self.b(h).relu()) + x


@pytest.mark.parametrize("device", devices)
def test_parameters_used_out_of_layout_order_load_in_runs_per_chunk(device, monkeypatch):
    """A chunk's copies follow the layout, whatever the order of use: neighbours within a chunk
    still copy together, the others apart. Outputs and gradients equal the unwrapped model's."""
    monkeypatch.setattr(loading_module, "CHUNK_BYTES", HIDDEN * HIDDEN * 4)  # a matrix closes a chunk
    torch.manual_seed(0)
    model = nn.Sequential(Crossed(), Crossed())
    reference = copy.deepcopy(model).to(device)
    offtensor.wrap(model, lambda name, m: isinstance(m, Crossed), device=device)
    for _ in range(3):
        x = torch.randn(3, HIDDEN).to(device)
        out, ref = model(x), reference(x)
        torch.testing.assert_close(out, ref, **tolerances(device))
        out.sum().backward()
        ref.sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(host(p.grad), host(q.grad), **tolerances(device), msg=name)
            p.grad = q.grad = None
    for scope, plan in _plans(model):
        _check_cover(scope, plan)
        assert [s.name.rsplit(".", 2)[-2:] for s in scope.copy_order] == [
            ["a", "bias"], ["b", "weight"], ["b", "bias"], ["a", "weight"]]
        # Chunks [a.bias, b.weight] (neighbours in the layout: one copy), [b.bias, a.weight]
        # (the first and the last: two).
        assert [len(chunk.direct) for chunk in plan.chunks] == [1, 2]


def _compressed_reference(model: nn.Module, device: str) -> nn.Module:
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.startswith("blocks.") and p.dim() >= 2 and p.numel() >= MIN_NUMEL:
                p.copy_(quantize_dequantize(p, "fp8"))
    return reference.to(device)


def _fp8_outputs(device: str, monkeypatch: pytest.MonkeyPatch, fused: bool) -> tuple[list[torch.Tensor], object]:
    model = _model(torch.bfloat16).requires_grad_(False).eval()
    if not fused:
        monkeypatch.setattr(FusedDequantization, "plan", classmethod(lambda cls, chunks, device: None))
    offtensor.wrap(model, device=device, policy=offtensor.Policy(frozen_format="fp8"))
    model.to(device)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 8, generator=gen).to(device, torch.bfloat16) for _ in range(3)]
    with torch.no_grad():
        outs = [model(x) for x in xs]
    monkeypatch.undo()
    return outs, model


@pytest.mark.parametrize("chunk_bytes", [4096, 32 * 2**20], ids=["small-chunks", "one-chunk"])
@pytest.mark.parametrize("device", devices)
def test_a_compressed_load_stages_its_matrices_in_runs_over_the_biases(device, chunk_bytes, monkeypatch):
    """The staged matrices of an fp8 load copy as runs of the host buffer over the biases
    between them, which copy straight into their device copies; the outputs are the resident
    compressed model's."""
    monkeypatch.setattr(loading_module, "CHUNK_BYTES", chunk_bytes)
    reference = _compressed_reference(_model(torch.bfloat16).requires_grad_(False).eval(), device)
    model = _model(torch.bfloat16).requires_grad_(False).eval()
    offtensor.wrap(model, device=device, policy=offtensor.Policy(frozen_format="fp8"))
    model.to(device)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(5, 8, generator=gen).to(device, torch.bfloat16)
            torch.testing.assert_close(model(x), reference(x), **tolerances(device, torch.bfloat16))
    plans = _plans(model)
    assert len(plans) == 3
    for scope, plan in plans:
        _check_cover(scope, plan)
        converts = [s.name.rsplit(".", 2)[-2] for chunk in plan.chunks for s in chunk.converts]
        assert sorted(converts) == ["fc1", "fc2"]
        if chunk_bytes > 4096:  # one chunk: fc1.weight, fc1.bias, fc2.weight staged as one run
            (chunk,) = plan.chunks
            assert len(chunk.staged) == 1
            assert len(chunk.direct) == 3  # the norm's two (neighbours), fc1.bias, fc2.bias
        assert (plan.fused is not None) == (device == "cuda" and _has_triton())


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("chunk_bytes", [4096, 32 * 2**20], ids=["small-chunks", "one-chunk"])
def test_cuda_one_kernel_per_chunk_gives_the_bits_of_one_kernel_per_matrix(chunk_bytes, monkeypatch):
    """FusedDequantization (one kernel over a chunk's matrices) writes exactly what the
    conversions one by one write."""
    pytest.importorskip("triton")
    monkeypatch.setattr(loading_module, "CHUNK_BYTES", chunk_bytes)
    fused, model = _fp8_outputs("cuda", monkeypatch, fused=True)
    assert all(plan.fused is not None for _, plan in _plans(model))
    monkeypatch.setattr(loading_module, "CHUNK_BYTES", chunk_bytes)
    single, model = _fp8_outputs("cuda", monkeypatch, fused=False)
    assert all(plan.fused is None for _, plan in _plans(model))
    for a, b in zip(fused, single, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_cuda_segment_dequantization_matches_the_one_matrix_kernel_and_writes_nothing_else(dtype):
    """dequantize_segments over a table of matrices at offsets in shared buffers: each output
    bit-identical to dequantize_rows of that matrix; the bytes between outputs untouched."""
    pytest.importorskip("triton")
    from offtensor.storage.kernels import dequantize_rows, dequantize_segments

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1, 1), (3, 2049), (513, 4096), (7, 33), (2, 5000)]
    size = dtype.itemsize
    values = torch.zeros(2**24, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.zeros(2**16, dtype=dtype, device="cuda")
    out = torch.full((2**23,), float("nan"), dtype=dtype, device="cuda")
    rows, v_at, s_at, o_at, expected = [], 0, 0, 0, []
    for r, c in shapes:
        v = (torch.randn(r, c, device="cuda", generator=gen) * 300).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = (torch.rand(r, device="cuda", generator=gen) * 10 + 1e-3).to(dtype)
        values[v_at : v_at + r * c] = v.flatten()
        scales[s_at : s_at + r] = s
        ref = torch.empty(r, c, dtype=dtype, device="cuda")
        dequantize_rows(v, s, ref)
        expected.append((o_at, ref))
        rows.append([v_at, s_at, o_at, r * c, c])
        v_at, s_at, o_at = v_at + r * c + 64, s_at + r + 64 // size, o_at + r * c + 128
    table = torch.tensor([[0, 0, 0, 0, 1], *rows], dtype=torch.int64, device="cuda")  # row 0 unused
    dequantize_segments(values, scales, out, table, 1, len(shapes), max(r * c for r, c in shapes))
    written = torch.zeros(out.numel(), dtype=torch.bool, device="cuda")
    for at, ref in expected:
        got = out[at : at + ref.numel()]
        assert torch.equal(got.view(torch.uint8), ref.flatten().view(torch.uint8))
        written[at : at + ref.numel()] = True
    assert out[~written].isnan().all()
