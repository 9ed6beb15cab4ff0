"""Policy(frozen_format="fp8" | "int8"): frozen masters compressed on the host, dequantized on
the device (Note [compressed masters] in storage/compress.py).

The reference is the same model with its frozen matrices quantized and dequantized the same way
(`quantize_dequantize`), computed resident: the offloaded model must match it exactly on the
CPU. The error against the unquantized model is measured separately, and bounded.
"""

from __future__ import annotations

import contextlib
import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    BlockStack,
    ResidualBlock,
    assert_all_scopes_offloaded,
    device_layout_bytes,
    devices,
    host,
    requires_cuda,
    tolerances,
)
from torch import nn

import offtensor
from offtensor.engine.engine import find_engine as _find_engine
from offtensor.storage.compress import MIN_NUMEL, quantize_dequantize

FORMATS = ["fp8", "int8"]
HIDDEN = 64  # fc1 is 64 x 128: above MIN_NUMEL, compressed


def _model(dtype: torch.dtype = torch.bfloat16, n_blocks: int = 3) -> BlockStack:
    model = BlockStack([ResidualBlock(HIDDEN) for _ in range(n_blocks)], 8, HIDDEN, 4).to(dtype)
    return model


def _compressed_reference(model: nn.Module, fmt: str, device: str) -> nn.Module:
    """A plain copy of `model` whose frozen block matrices hold their compressed values."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.startswith("blocks.") and p.dim() >= 2 and not p.requires_grad and p.numel() >= MIN_NUMEL:
                p.copy_(quantize_dequantize(p, fmt))
    return reference.to(device)


def _wrap(model: nn.Module, device: str, **policy) -> nn.Module:
    offtensor.wrap(model, device=device, policy=offtensor.Policy(**policy))
    return model.to(device)


def _packed_slots(model: nn.Module) -> list:
    return [s for scope in _find_engine(model).scopes for s in scope.slots if s.packed is not None]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("device", devices)
def test_inference_matches_the_resident_model_with_the_same_compressed_weights(device, dtype, fmt):
    model = _model(dtype).requires_grad_(False).eval()
    reference = _compressed_reference(model, fmt, device)
    _wrap(model, device, frozen_format=fmt)
    assert len(_packed_slots(model)) == 6  # fc1 and fc2 of each block
    x = torch.randn(5, 8, dtype=dtype, device=device)
    with torch.no_grad():
        out = model(x)
        out2 = model(x)  # a second pass: learned order, prefetch
        expected = reference(x)
    torch.testing.assert_close(out, expected, **tolerances(device, dtype))
    torch.testing.assert_close(out2, expected, **tolerances(device, dtype))
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(host(p), host(r), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("device", devices)
def test_only_frozen_matrices_are_compressed(device, fmt):
    model = _model()
    model.blocks[1].requires_grad_(False)
    _wrap(model, device, frozen_format=fmt)
    packed = {s.name for s in _packed_slots(model)}
    assert packed == {"blocks.1.fc1.weight", "blocks.1.fc2.weight"}  # not norms, biases, trainables


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("device", devices)
def test_compute_dtype_casts_the_dequantized_values(device, fmt):
    model = _model(torch.float32).requires_grad_(False)
    reference = _compressed_reference(model, fmt, device)
    reference.blocks.to(torch.bfloat16)  # fp32 masters cast to the compute dtype
    _wrap(model, device, frozen_format=fmt, compute_dtype=torch.bfloat16)
    x = torch.randn(5, 8, device=device)
    with torch.no_grad():
        # Only the blocks compute in bf16 here: run the reference's blocks the same way.
        h = model.input(x).bfloat16()
        for block in model.blocks:
            h = block(h)
        r = reference.input(x).bfloat16()
        for block in reference.blocks:
            r = block(r)
    torch.testing.assert_close(h, r, **tolerances(device, torch.bfloat16))


class _LoRALinear(nn.Module):
    """A frozen base linear plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features, dtype=base.weight.dtype) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank, dtype=base.weight.dtype) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


def _lora_model(dtype: torch.dtype) -> BlockStack:
    model = _model(dtype)
    model.requires_grad_(False)
    for block in model.blocks:
        block.fc1 = _LoRALinear(block.fc1)
        block.fc2 = _LoRALinear(block.fc2)
    model.input.requires_grad_(True)  # (reentrant checkpointing needs inputs requiring grad)
    return model


def _lora_steps(model: nn.Module, device: str, dtype: torch.dtype, steps: int = 3) -> list[torch.Tensor]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen).to(device, dtype)
        y = torch.randn(4, 4, generator=gen).to(device, dtype)
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y.float())
        loss.backward()
        losses.append(host(loss))
        if len(losses) < steps:
            opt.step()
    return losses


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("device", devices)
def test_lora_training_matches_the_resident_model_with_the_same_compressed_base(device, fmt, checkpoint):
    dtype = torch.bfloat16
    model = _lora_model(dtype)
    model.checkpoint = checkpoint
    reference = _compressed_reference(model, fmt, device)
    _wrap(model, device, frozen_format=fmt, param_filter=offtensor.frozen_only)
    assert len(_packed_slots(model)) == 6
    got = _lora_steps(model, device, dtype)
    expected = _lora_steps(reference, device, dtype)
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), **tolerances(device, dtype))
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(host(p.grad), host(r.grad), msg=name, **tolerances(device, dtype))
        torch.testing.assert_close(host(p), host(r), msg=name, **tolerances(device, dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_host_bytes_of_compressed_scopes_about_halve(fmt):
    plain, compressed = _model(n_blocks=2).requires_grad_(False), _model(n_blocks=2).requires_grad_(False)
    _wrap(plain, "cpu")
    _wrap(compressed, "cpu", frozen_format=fmt)
    ratio = offtensor.summary(compressed).host_bytes / offtensor.summary(plain).host_bytes
    # The matrices take 1 byte per element plus a scale per row; norms and biases stay bf16.
    matrices = sum(s.param.numel() for s in _packed_slots(compressed))
    total = sum(p.numel() for p in compressed.blocks.parameters())
    print(f"{fmt}: host bytes {ratio:.3f}x of bf16 ({matrices / total:.1%} of the elements compressed)")
    assert ratio < 0.56


def test_host_memory_of_a_large_compressed_scope_halves():
    """The allocation itself, measured: a 64 MiB bf16 block takes about 32 MiB compressed."""
    plain = nn.ModuleList([nn.Linear(4096, 8192, bias=False).bfloat16().requires_grad_(False)])
    compressed = copy.deepcopy(plain)
    offtensor.wrap(plain, device="cpu")
    offtensor.wrap(compressed, device="cpu", policy=offtensor.Policy(frozen_format="fp8"))
    sizes = [_find_engine(m).scopes[0].masters.flat.untyped_storage().nbytes() for m in (plain, compressed)]
    print(f"host buffer: bf16 {sizes[0] / 2**20:.1f} MiB, fp8 {sizes[1] / 2**20:.1f} MiB")
    assert sizes[1] <= 0.51 * sizes[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_against_the_unquantized_model_is_bounded(fmt):
    model = _model(torch.float32, n_blocks=4).requires_grad_(False)
    exact = copy.deepcopy(model)
    _wrap(model, "cpu", frozen_format=fmt)
    x = torch.randn(64, 8)
    with torch.no_grad():
        err = (model(x) - exact(x)).norm() / exact(x).norm()
        w, w_exact = model.blocks[0].fc1.weight, exact.blocks[0].fc1.weight
        werr = (w - w_exact).norm() / w_exact.norm()
    print(f"{fmt}: relative error of the output {err:.2e}, of a weight {werr:.2e}")
    bound = 0.05 if fmt == "fp8" else 0.01  # e4m3 keeps 3 mantissa bits; int8 127 steps a row
    assert werr < bound
    assert err < bound
    assert err > 0  # it is lossy: a test comparing to the exact model must see it


@pytest.mark.parametrize("fmt", FORMATS)
def test_float16_rows_too_small_for_their_scale_are_named_in_a_warning(fmt):
    """A float16 row whose largest value is tiny (1e-7 here) needs a scale below float16's
    range: it underflows, and the row's values round to zero (int8) or to a few bits (fp8).
    Silent, that is a wrong answer; it warns, naming the parameter and the fix. Rows of small
    but ordinary values (1e-4: subnormal scales that still hold them) and bfloat16 (float32's
    exponent range) do not warn."""
    import warnings

    for dtype, factor, warns in [(torch.float16, 1e-6, True), (torch.float16, 1e-3, False),
                                 (torch.bfloat16, 1e-6, False)]:
        model = _model(dtype).requires_grad_(False)
        with torch.no_grad():
            model.blocks[1].fc1.weight[:3] *= factor
        exact = model.blocks[1].fc1.weight.detach().float().clone()
        if warns:
            with pytest.warns(UserWarning, match=r"3 of 128 rows of compressed parameter 'blocks.1.fc1.weight' "
                                                 r"lost over 10%.*Load the model in torch.bfloat16"):
                _wrap(model, "cpu", frozen_format=fmt)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                _wrap(model, "cpu", frozen_format=fmt)
        got = model.blocks[1].fc1.weight.detach().float()
        error = ((got[:3] - exact[:3]).norm() / exact[:3].norm()).item()
        assert (error > 0.1) == warns, (dtype, factor, error)  # the warning says what happened


@pytest.mark.parametrize("device", devices)
def test_state_dict_and_reads_report_the_compressed_values(device):
    model = _model().requires_grad_(False)
    reference = _compressed_reference(model, "fp8", "cpu")
    _wrap(model, device, frozen_format="fp8")
    w = model.blocks[0].fc1.weight
    expected = reference.blocks[0].fc1.weight
    assert torch.equal(model.state_dict()["blocks.0.fc1.weight"], expected)
    assert torch.equal(w.detach(), expected) and torch.equal(w.data, expected)
    assert w.tolist() == expected.tolist()
    assert torch.equal(w * 2, expected * 2) and torch.equal(w.T, expected.T)
    assert w.is_contiguous() and w.stride() == expected.stride()
    assert torch.equal(copy.deepcopy(model).blocks[0].fc1.weight, expected)
    assert torch.equal(pickle.loads(pickle.dumps(model.blocks[0])).fc1.weight, expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("device", devices)
def test_writes_through_the_parameter_requantize(device, fmt):
    model = _model().requires_grad_(False)
    _wrap(model, device, frozen_format=fmt)
    x = torch.randn(3, 8, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        model(x)  # loaded once: a write must not leave a stale device copy
    new = torch.randn(128, HIDDEN, dtype=torch.bfloat16)
    w = model.blocks[0].fc1.weight
    with torch.no_grad():
        w.copy_(new)
    assert torch.equal(w.detach(), quantize_dequantize(new, fmt))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["blocks.1.fc2.weight"] = torch.randn(HIDDEN, 128, dtype=torch.bfloat16)
    model.load_state_dict(sd)
    assert torch.equal(model.blocks[1].fc2.weight.detach(), quantize_dequantize(sd["blocks.1.fc2.weight"], fmt))
    torch.nn.init.zeros_(model.blocks[2].fc1.weight)
    assert not model.blocks[2].fc1.weight.detach().any()
    model.blocks[2].fc2.weight.data = new.T.contiguous()
    assert torch.equal(model.blocks[2].fc2.weight.detach(), quantize_dequantize(new.T, fmt))
    # The forward computes with what the parameters report.
    plain = copy.deepcopy(model).to(device)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), **tolerances(device, torch.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("device", devices)
def test_a_loaded_compressed_scope_computes_with_plain_device_copies(device, fmt, monkeypatch):
    """Once a compressed scope is RESIDENT (kept here), its calls expose its dequantized device
    copies (Note [calls of a loaded scope] in engine/hooks.py): module code reads plain tensors
    and no op goes through __torch_function__; the outputs stay those of the compressed reference."""
    model = _model().requires_grad_(False)
    reference = _compressed_reference(model, fmt, device)
    _wrap(model, device, frozen_format=fmt, vram_budget=2**40)
    x = torch.randn(3, 8, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        model(x)  # the first call learns the copy order
        dispatched, seen = [], []
        original = offtensor.OffloadedParameter.__torch_function__.__func__

        def counted(cls, func, types, args=(), kwargs=None):
            dispatched.append(func)
            return original(cls, func, types, args, kwargs)

        monkeypatch.setattr(offtensor.OffloadedParameter, "__torch_function__", classmethod(counted))
        hook = model.blocks[1].fc1.register_forward_pre_hook(lambda m, args: seen.append(type(m.weight).__name__))
        out = model(x)
        hook.remove()
    assert seen == ["ExposedCopy"] and dispatched == [], (seen, dispatched)
    assert _packed_slots(model)
    with torch.no_grad():
        torch.testing.assert_close(out, reference(x), **tolerances(device, torch.bfloat16))


@pytest.mark.parametrize("how,when", [
    ("through_the_attribute", "first_call"), ("through_the_attribute", "loaded"),
    ("through_the_parameter", "first_call"), ("through_the_parameter", "loaded"),
    ("through_data", "loaded"),  # in a call served op by op `p.data` is a copy: a write is lost
])
def test_a_write_to_a_compressed_parameter_inside_its_forward_raises_and_changes_nothing(how, when):
    """Inside its scope's forward a compressed parameter is a device copy of its dequantized
    values (or, in a scope's first call, served op by op): a write there raises, naming it, at
    the op or at the call's end; the master keeps its values and the next forward computes as
    before (Note [compressed masters] in storage/compress.py)."""
    model = _model().requires_grad_(False)
    block = model.blocks[1]
    _wrap(model, "cpu", frozen_format="fp8", vram_budget=2**40)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        if when == "loaded":
            model(x)
        before, expected = block.fc1.weight.detach().clone(), copy.deepcopy(model)(x)

    def write(module, args):
        with torch.no_grad():
            if how == "through_the_attribute":
                module.fc1.weight.mul_(2)
            elif how == "through_the_parameter":
                dict(module.named_parameters())["fc1.weight"].mul_(2)
            else:
                module.fc1.weight.data.mul_(2)

    handle = block.register_forward_pre_hook(write)
    with pytest.raises(RuntimeError, match=r"'blocks\.1\.fc1\.weight'.*inside the forward"), torch.no_grad():
        model(x)
    handle.remove()
    assert torch.equal(block.fc1.weight.detach(), before)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_unfreezing_a_compressed_parameter_raises_naming_it():
    model = _model().requires_grad_(False)
    _wrap(model, "cpu", frozen_format="fp8")
    with pytest.raises(RuntimeError, match=r"'blocks.0.fc1.weight' is stored compressed .*frozen_format='fp8'"):
        model.blocks[0].fc1.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="cannot be trained"):
        model.blocks[0].fc1.weight.requires_grad = True
    with pytest.raises(RuntimeError, match="'blocks.0.fc1.weight' is stored compressed"):
        model.requires_grad_(True)
    model.blocks[0].fc1.weight.requires_grad_(False)  # fine


def test_unwrap_gives_plain_parameters_with_the_compressed_values():
    model = _model().requires_grad_(False)
    reference = _compressed_reference(model, "int8", "cpu")
    _wrap(model, "cpu", frozen_format="int8")
    offtensor.unwrap(model)
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert type(p) is nn.Parameter and p.is_contiguous()
        assert torch.equal(p, r), name


def test_policy_errors_name_the_option():
    with pytest.raises(ValueError, match="frozen_format must be 'fp8', 'int8' or None, got 'fp4'"):
        offtensor.Policy(frozen_format="fp4")
    with pytest.raises(ValueError, match="frozen_format and cast='host' do not combine"):
        offtensor.Policy(frozen_format="fp8", compute_dtype=torch.bfloat16, cast="host")


@pytest.mark.parametrize("device", devices)
def test_a_compressed_scope_loads_progressively_in_chunks(device, monkeypatch):
    """After the first forward a compressed scope's load goes chunk by chunk (its dequantization
    per chunk, Note [progressive loads]); the staging buffer is gone once every chunk is
    enqueued, and the results are those of the resident compressed model."""
    import offtensor.scopes.loading as loading_module

    monkeypatch.setattr(loading_module, "CHUNK_BYTES", 4096)  # fc1 alone is 8 KiB of fp8
    model = _model(torch.bfloat16).requires_grad_(False).eval()
    reference = _compressed_reference(model, "fp8", device)
    _wrap(model, device, frozen_format="fp8")
    engine = _find_engine(model)
    chunks = []
    original = loading_module.LoadProgress.copy_more

    def spy(loading, need):
        original(loading, need)
        chunks.append((len(loading.chunk_ready), loading.staging))

    monkeypatch.setattr(loading_module.LoadProgress, "copy_more", spy)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(5, 8, dtype=torch.bfloat16, device=device)
            torch.testing.assert_close(model(x), reference(x), **tolerances("cuda", torch.bfloat16))
    assert chunks, "no progressive load of a compressed scope"
    assert all(n >= 2 and staging is None for n, staging in chunks)
    assert all(scope.copy_order is not None for scope in engine.scopes)


@pytest.mark.parametrize("device", devices)
def test_steady_state_training_never_dequantizes_on_the_host(device, monkeypatch):
    """A compressed master is dequantized on the device by its scope's load; reads of the
    parameter's metadata (`p.grad`, read for every parameter by the backward's accumulation
    check; `p.shape`, `p.requires_grad`) must not unpack the values on the host, which at a 70B
    layer's size costs a second per backward."""
    from offtensor.storage.compress import PackedMaster

    model = _lora_model(torch.bfloat16)
    _wrap(model, device, frozen_format="fp8")
    w = _packed_slots(model)[0].param
    _lora_steps(model, device, torch.bfloat16, steps=1)  # warm-up: orders learned
    unpacks = []
    original = PackedMaster.unpack
    monkeypatch.setattr(PackedMaster, "unpack", lambda self: (unpacks.append(self.name), original(self))[1])
    _lora_steps(model, device, torch.bfloat16, steps=2)
    assert w.grad is None and w.shape == w._ot.packed.shape and not w.requires_grad and w.is_leaf
    assert unpacks == []
    w.detach()  # a read of the values does unpack them
    assert unpacks == [w._ot.name]


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_cuda_fused_fp8_dequantization_is_bit_identical_to_the_two_kernels(dtype):
    """Note [fused fp8 dequantization]: the one-kernel path that CUDA loads use gives exactly the
    bits of `values.to(dtype) * scale[:, None]`, on shapes that end mid-block and mid-row."""
    pytest.importorskip("triton")
    from offtensor.storage.fp8 import _fused_dequantize
    from offtensor.storage.kernels import dequantize_rows

    assert _fused_dequantize() is dequantize_rows  # CUDA loads take the fused path here
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, cols in [(1, 1), (3, 2049), (513, 4096), (7, 33), (2, 5000)]:
        x = torch.randn(rows, cols, device="cuda", generator=gen) * 300
        values = x.clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = (torch.rand(rows, device="cuda", generator=gen) * 10 + 1e-3).to(dtype)
        out = torch.full((rows, cols), float("nan"), dtype=dtype, device="cuda")
        dequantize_rows(values, scale, out)
        expected = values.to(dtype) * scale[:, None]
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), (rows, cols)


@pytest.mark.cuda
@requires_cuda
def test_cuda_one_kernel_dequantizes_matrices_of_every_size_into_their_places_only():
    """Note [load plans]: a chunk's matrices in one launch, each as many tiles as it has (a small
    one beside a large one, rows and columns ending mid-tile, an empty one), the same bits as the
    two kernels, and nothing written between or after them."""
    pytest.importorskip("triton")
    from offtensor.storage.kernels import dequantize_segments, tiles_of

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(3, 5), (1030, 300), (0, 7), (9, 257), (64, 3072), (17, 1)]
    dtype = torch.bfloat16
    values = [(torch.randn(shape, device="cuda", generator=gen) * 300).clamp(-448, 448).to(torch.float8_e4m3fn)
              for shape in shapes]
    scales = [(torch.rand(shape[0], device="cuda", generator=gen) * 10 + 1e-3).to(dtype) for shape in shapes]
    table, value_at, scale_at, out_at = [], 0, 0, 0
    for shape in shapes:
        numel = shape[0] * shape[1]
        table.append([value_at, scale_at, out_at, numel, shape[1]])
        value_at, scale_at, out_at = value_at + numel, scale_at + shape[0], out_at + numel + 3  # 3 values apart
    flat_values = torch.cat([v.flatten().view(torch.uint8) for v in values]).view(torch.float8_e4m3fn)
    out = torch.full((out_at,), float("nan"), dtype=dtype, device="cuda")
    tiles = max(tiles_of(numel, cols) for *_, numel, cols in table if numel)
    dequantize_segments(flat_values, torch.cat(scales), out, torch.tensor(table, device="cuda"), 1, len(shapes) - 1,
                        tiles)  # every matrix but the first
    for i, (shape, (*_, at, numel, _cols)) in enumerate(zip(shapes, table, strict=True)):
        got = out[at : at + numel]
        if i == 0:
            assert got.isnan().all()
        else:
            expected = (values[i].to(dtype) * scales[i][:, None]).flatten()
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), shape
        assert out[at + numel : at + numel + 3].isnan().all(), shape


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("device", devices)
def test_a_vram_budget_keeps_compressed_frozen_scopes_dequantized_once(device, fmt):
    """A compressed frozen base under Policy(vram_budget): the kept scopes (the first and the
    last of six) load and dequantize once for all steps, the rest stream, and the LoRA-style
    training (input layer and head trainable) matches the resident model with the same
    compressed weights."""
    model = _model(torch.float32, n_blocks=6)
    model.blocks.requires_grad_(False)
    reference = _compressed_reference(model, fmt, device)
    budget = (2 + 1 + 2) * device_layout_bytes(model.blocks[0])  # streaming (prefetch 1) + 2 kept
    _wrap(model, device, frozen_format=fmt, layout="spread", vram_budget=budget)
    assert len(_packed_slots(model)) == 12
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(5, 8, generator=gen).to(device), torch.randn(5, 4, generator=gen).to(device)
        loss, ref_loss = F.mse_loss(model(x), y), F.mse_loss(reference(x), y)
        torch.testing.assert_close(loss, ref_loss, **tolerances(device))
        loss.backward()
        ref_loss.backward()
        for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
            if r.requires_grad:
                torch.testing.assert_close(host(p.grad), host(r.grad), **tolerances(device), msg=name)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    scopes = {s.name: s for s in offtensor.summary(model).scopes}
    # The budget keeps the first block and spreads the other kept one over the rest: the last.
    assert [scopes[f"blocks.{i}"].kept for i in range(6)] == [True, False, False, False, False, True]
    assert [scopes[f"blocks.{i}"].loads for i in (0, 5)] == [1, 1]
    # The streamed ones load in each forward and backward (6 times), less each time a backward
    # leaves one resident for the next forward, which computes it first (1 and 2 here: frozen,
    # no step writes them; Note [carried into the next forward] in budget/vram.py).
    assert all(scopes[f"blocks.{i}"].loads >= 3 for i in range(1, 5))
    with torch.no_grad():
        x = torch.randn(5, 8, generator=gen).to(device)
        torch.testing.assert_close(model.eval()(x), reference.eval()(x), **tolerances(device))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fp8_on_the_second_gpu_while_the_first_is_current_matches_the_resident_model():
    """A model wrapped for cuda:1 while cuda:0 is the current device: its loads dequantize on
    cuda:1's cast stream (Triton launches on the current device unless told otherwise)."""
    model = _model(torch.bfloat16).requires_grad_(False).eval()
    reference = _compressed_reference(model, "fp8", "cuda:1")
    _wrap(model, "cuda:1", frozen_format="fp8")
    torch.cuda.set_device(0)
    x = torch.randn(5, 8, dtype=torch.bfloat16, device="cuda:1")
    with torch.no_grad():
        for _ in range(3):  # the first pass loads on demand, the next ones progressively
            torch.testing.assert_close(model(x), reference(x), **tolerances("cuda", torch.bfloat16))


def _tied_reference(model: nn.Module, fmt: str) -> nn.Module:
    """A plain copy of `model` whose compressed matrices (all those above MIN_NUMEL, the tied
    embedding included) hold their compressed values."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            if p.dim() >= 2 and p.numel() >= MIN_NUMEL:
                p.copy_(quantize_dequantize(p, fmt))
    return reference


@pytest.mark.parametrize("tied_side", ["head_in_block", "embedding_selected"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_tied_and_shared_compressed_weights_round_trip_and_stay_tied(fmt, tied_side, tmp_path):
    """A tied embedding and head compressed in one scope, and a matrix shared by two scopes:
    state_dict, torch.save of the state dict and of the model, deepcopy, pickle and
    load_state_dict (also assign=True) all give the compressed values, copies stay tied, and a
    write through one name is what every user of the shared parameter computes with."""
    from conftest import TiedLM, tied_lm_predicate

    model = TiedLM(tied_side, vocab=128, hidden=HIDDEN, n_blocks=3).requires_grad_(False)
    model.blocks[1].fc1.weight = model.blocks[0].fc1.weight  # shared by two scopes
    offtensor.wrap(model, tied_lm_predicate(tied_side), device="cpu", policy=offtensor.Policy(frozen_format=fmt))
    head = "blocks.3.proj.weight" if tied_side == "head_in_block" else "head.weight"
    assert model.get_parameter(head) is model.embed.weight and model.embed.weight._ot.packed is not None
    assert model.blocks[0].fc1.weight._ot.packed is not None
    reference = _tied_reference(model, fmt)  # a deepcopy: plain parameters, still tied and shared
    assert reference.get_parameter(head) is reference.embed.weight
    tokens = torch.randint(0, 128, (2, 6))

    def check(m: nn.Module, what: str) -> None:
        assert m.get_parameter(head) is m.embed.weight, what
        assert m.blocks[1].fc1.weight is m.blocks[0].fc1.weight, what
        with torch.no_grad():
            torch.testing.assert_close(m(tokens), reference(tokens), rtol=0, atol=0, msg=what)

    check(model, "wrapped")
    state = model.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key], value), key
    torch.save(state, tmp_path / "state.pt")
    torch.save(model, tmp_path / "model.pt")
    check(torch.load(tmp_path / "model.pt", weights_only=False), "torch.save(model)")
    check(copy.deepcopy(model), "deepcopy")
    check(pickle.loads(pickle.dumps(model)), "pickle")
    model.load_state_dict(torch.load(tmp_path / "state.pt"))  # values already compressed: no change
    check(model, "load_state_dict of its own state")
    new = {k: torch.randn_like(v) for k, v in state.items()}
    model.load_state_dict(new)
    reference.load_state_dict(new)
    reference = _tied_reference(reference, fmt)
    check(model, "load_state_dict of new values")
    with torch.no_grad():
        model.blocks[1].fc1.weight.copy_(torch.randn(2 * HIDDEN, HIDDEN))  # through the second scope
        reference.blocks[1].fc1.weight.copy_(model.blocks[0].fc1.weight)
    check(model, "write through the second scope")
    model.load_state_dict(state, assign=True)
    reference.load_state_dict(state)
    check(model, "load_state_dict(assign=True)")
    assert isinstance(model.embed.weight, offtensor.OffloadedParameter)


class _Boom(Exception):
    pass


@pytest.mark.parametrize("where", ["forward_no_grad", "forward", "recompute", "backward"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("device", devices)
def test_an_exception_in_a_compressed_model_leaves_no_device_copy_and_the_next_step_exact(
        device, fmt, where, monkeypatch):
    """An exception in the middle of a forward (loads progressive, chunk by chunk, converting
    on the cast stream), in the recompute of a checkpointed block, or in backward: no device copy
    or staging buffer is left once the next forward starts, and that step matches the resident
    model with the same compressed weights."""
    import offtensor.scopes.loading as loading_module

    monkeypatch.setattr(loading_module, "CHUNK_BYTES", 4096)  # several chunks per compressed scope
    model = _lora_model(torch.float32)
    model.checkpoint = "non_reentrant" if where == "recompute" else None
    reference = _compressed_reference(model, fmt, device)
    _wrap(model, device, frozen_format=fmt)
    x = torch.randn(4, 8, device=device)
    model(x).sum().backward()  # learned orders: the next loads are progressive
    calls = []

    def boom(module, args, output=None):
        calls.append(1)
        if where != "recompute" or len(calls) > 1:  # the recompute is the second call
            raise _Boom

    base = model.blocks[1].fc1.base
    handle = (base.register_full_backward_hook(boom) if where == "backward" else base.register_forward_hook(boom))
    with pytest.raises(_Boom), torch.set_grad_enabled(where != "forward_no_grad"):
        model(x).sum().backward()
    handle.remove()
    engine = _find_engine(model)
    if where in ("forward_no_grad", "forward"):  # a failed backward is cleaned up at the next forward
        assert_all_scopes_offloaded(model)
    for p in (*model.parameters(), *reference.parameters()):
        p.grad = None
    out, expected = model(x), reference(x)
    assert all(scope.loading is None or scope.loading.staging is None for scope in engine.scopes)
    torch.testing.assert_close(out, expected, **tolerances(device))
    out.sum().backward()
    expected.sum().backward()
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if r.requires_grad:
            torch.testing.assert_close(host(p.grad), host(r.grad), msg=name, **tolerances(device))
    assert_all_scopes_offloaded(model)


# Note [fp8 on the CPU]: the CPU restores fp8 through float16 bits; each test below compares it
# bit for bit with the two kernels it replaces, `values.to(dtype)` then `mul_(scale)`.
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fp8_codes(nan: bool) -> torch.Tensor:
    """Every e4m3 code (uint8 0..255), or every one but the two NaN codes."""
    codes = torch.arange(256, dtype=torch.uint8)
    return (codes if nan else codes[(codes & 0x7F) != 0x7F]).view(torch.float8_e4m3fn)


def _wide_scales(dtype: torch.dtype) -> torch.Tensor:
    """Scales over dtype's range up to max / 256: every power of two from the smallest subnormal,
    random mantissas at random exponents, the edges, zero and negatives."""
    info = torch.finfo(dtype)
    limit, smallest = info.max / 256, info.tiny * info.eps
    low, high = round(math.log2(smallest)), math.floor(math.log2(limit))
    gen = torch.Generator().manual_seed(0)
    powers = torch.ldexp(torch.ones(high - low + 1, dtype=torch.float64), torch.arange(low, high + 1))
    random = torch.ldexp(1 + torch.rand(512, generator=gen, dtype=torch.float64),
                         torch.randint(low, high + 1, (512,), generator=gen))
    edges = torch.tensor([smallest, info.tiny - smallest, info.tiny, 1 / 3, info.max / 448, limit, 0.0],
                         dtype=torch.float64)
    scales = torch.cat([powers, random, edges]).to(dtype).clamp(max=limit)
    return torch.cat([scales, -scales[::7]])


def _two_kernels(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What RowScaled.dequantize computes: PyTorch's fp8 conversion, then the scale."""
    out = torch.empty(values.shape, dtype=scale.dtype)
    out.copy_(values)
    out.mul_(scale[:, None])
    return out


def _cpu_restores(values: torch.Tensor, scale: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each CPU restore of fp8 host bytes holding `values` and `scale`, with what the two kernels
    give: a load's (`unpack_into`, into the master's dtype and into another compute dtype) and a
    read's (`unpack`)."""
    from offtensor.storage.fp8 import FP8

    dtype, shape = scale.dtype, values.shape
    host = torch.empty(FP8.nbytes(shape, dtype), dtype=torch.uint8)
    stored_values, stored_scale = FP8.parts(host, dtype, shape)
    stored_values.view(torch.uint8).copy_(values.view(torch.uint8))
    stored_scale.copy_(scale)
    expected = _two_kernels(values, scale)
    loaded = torch.full(shape, float("nan"), dtype=dtype)
    FP8.unpack_into(loaded, host, dtype)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    cast = torch.full(shape, float("nan"), dtype=other)
    FP8.unpack_into(cast, host, dtype)
    return {"unpack_into": (loaded, expected), "unpack_into another dtype": (cast, expected.to(other)),
            "unpack": (FP8.unpack(host, dtype, shape), expected)}


def _assert_same_bits(restores: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    for how, (got, expected) in restores.items():
        bits = _INT_OF_SIZE[got.element_size()]
        assert got.dtype == expected.dtype and torch.equal(got.view(bits), expected.view(bits)), how


@pytest.fixture
def two_kernel_restores(monkeypatch) -> list[int]:
    """The row counts of the restores that take the two kernels (RowScaled.dequantize)."""
    from offtensor.storage.row_scaled import RowScaled

    calls: list[int] = []
    two_kernels = RowScaled.dequantize

    def counted(self, values, scale, target):
        calls.append(values.shape[0])
        two_kernels(self, values, scale, target)

    monkeypatch.setattr(RowScaled, "dequantize", counted)
    return calls


@contextlib.contextmanager
def _denormals(flushed: bool):
    """Denormals as usual, or flushed to zero (torch.set_flush_denormal) on one thread: PyTorch
    sets the mode for the calling thread only, so an op split over its other threads would mix
    both modes and give bits that depend on the split."""
    if not flushed:
        yield
        return
    threads = torch.get_num_threads()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("flushed", [False, True], ids=["denormals", "flush_denormal"])
@pytest.mark.parametrize("blocks", ["one_block", "many_blocks"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cpu_fp8_restore_is_bit_identical_to_the_two_kernels(dtype, blocks, flushed, two_kernel_restores,
                                                               monkeypatch):
    """Every non-NaN code times scales over the dtype's whole range (subnormal results, overflow
    to inf, tiny and huge scales) gives the two kernels' bits, through float16 (no two-kernel
    restore), in one scratch block or in blocks that end mid-matrix, denormals flushed or not."""
    if blocks == "many_blocks":
        monkeypatch.setattr("offtensor.storage.fp8._SCRATCH_NUMEL", 254 * 37)
    scales = _wide_scales(dtype)
    values = _fp8_codes(nan=False).expand(len(scales), -1).contiguous()
    with _denormals(flushed):
        _assert_same_bits(_cpu_restores(values, scales))
    assert two_kernel_restores == []


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cpu_fp8_nan_codes_restore_as_nan_through_the_two_kernels(dtype, two_kernel_restores, monkeypatch):
    """The NaN codes would read as +-480 through float16: a block holding one takes the two
    kernels, the others do not (a float16 target is restored whole, in place)."""
    monkeypatch.setattr("offtensor.storage.fp8._SCRATCH_NUMEL", 256)  # a row a block
    values = _fp8_codes(nan=True).expand(4, -1).contiguous()
    codes = values.view(torch.uint8)
    codes[0, [0x7F, 0xFF]] = 0  # row 0 holds no NaN code, row 1 only 0x7F, row 2 only 0xFF, row 3 both
    codes[1, 0xFF] = 0
    codes[2, 0x7F] = 0
    restores = _cpu_restores(values, torch.tensor([0.5, 3.0, 2.0**-10, 1.0], dtype=dtype))
    _assert_same_bits(restores)
    assert restores["unpack"][0].isnan().sum(dim=1).tolist() == [0, 1, 1, 2]
    per_restore = [4] if dtype == torch.float16 else [1, 1, 1]
    assert two_kernel_restores == per_restore * 3


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cpu_fp8_scales_beyond_max_over_256_restore_through_the_two_kernels(dtype, two_kernel_restores):
    """`scale * 256` would overflow (or is not a number): the matrix takes the two kernels."""
    info = torch.finfo(dtype)
    limit = torch.tensor(info.max / 256, dtype=dtype)
    values = _fp8_codes(nan=False).expand(2, -1).contiguous()
    for beyond in [torch.nextafter(limit, torch.tensor(math.inf, dtype=dtype)), info.max, math.inf, -math.inf,
                   math.nan]:
        two_kernel_restores.clear()
        _assert_same_bits(_cpu_restores(values, torch.tensor([1.0, beyond], dtype=dtype)))
        assert two_kernel_restores == [2, 2, 2], beyond


def test_packing_stores_nan_codes_for_rows_holding_nan_or_inf():
    """Why the CPU restore checks for NaN codes (Note [fp8 on the CPU]): the clamp keeps NaN and
    a row holding inf gets the scale inf (inf / inf is NaN); both read back as NaN."""
    from offtensor.storage.fp8 import FP8

    w = torch.ones(3, 4)
    w[1, 2], w[2, 3] = math.nan, math.inf
    host = torch.empty(FP8.nbytes(w.shape, w.dtype), dtype=torch.uint8)
    FP8.pack(host, w, w.dtype, w.shape, "w")
    values, scale = FP8.parts(host, w.dtype, w.shape)
    assert (values.view(torch.uint8) & 0x7F).eq(0x7F).sum(dim=1).tolist() == [0, 1, 1]
    assert torch.equal(scale, torch.tensor([1 / 448, 1.0, math.inf]))
    assert FP8.unpack(host, w.dtype, w.shape).isnan().sum(dim=1).tolist() == [0, 1, 4]
