"""Already-quantized models (torchao tensor subclasses, bitsandbytes 4-bit) offloaded as their
packed storage (Note [quantized weights] in model/quantized.py).

The reference is the same quantized model, deep-copied before `wrap` and kept resident on the
compute device: the offloaded model runs the same quantized kernels on the same packed bytes,
so on the CPU everything matches exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_all_scopes_offloaded,
    devices,
    host,
    mlp_of_blocks,
    tolerances,
    unwrapped_reference,
)
from master_guard import MasterGuard
from torch import nn

import offtensor
from offtensor.engine.engine import find_engine as _find_engine

torchao_quant = pytest.importorskip("torchao.quantization")

HIDDEN = 64


def _configs() -> dict[str, object]:
    from torchao.quantization.granularity import PerGroup

    q = torchao_quant
    return {
        "int8": q.Int8WeightOnlyConfig(),
        "fp8": q.Float8WeightOnlyConfig(),
        # Int4WeightOnlyConfig has no CPU kernel; intx int4 (int4 values, per-group scales) does.
        "intx-int4": q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
    }


CONFIGS = ["int8", "fp8", "intx-int4"]


def _in_blocks(module: nn.Module, fqn: str) -> bool:
    """The linears of the blocks (`blocks.N.` of the MLP, `model.layers.N.` of Llama)."""
    return isinstance(module, nn.Linear) and (fqn.startswith("blocks.") or ".layers." in fqn)


def quantized_mlp(config: str, device: str = "cpu", n_blocks: int = 3) -> nn.Module:
    """conftest's block MLP with the blocks' linears quantized by torchao (input and head not)."""
    model = mlp_of_blocks(n_blocks=n_blocks, hidden=HIDDEN).to(device)
    torchao_quant.quantize_(model, _configs()[config], filter_fn=_in_blocks)
    return model


def _wrap(model: nn.Module, device: str, **policy) -> nn.Module:
    offtensor.wrap(model, device=device, policy=offtensor.Policy(**policy))
    return model.to(device)


def _packed_bytes(module: nn.Module) -> int:
    """The inner tensors' bytes of the module's quantized weights."""
    total = 0
    for p in module.parameters():
        if hasattr(p, "__tensor_flatten__"):
            total += sum(getattr(p, n).numel() * getattr(p, n).element_size() for n in p.__tensor_flatten__()[0])
    return total


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("config", CONFIGS)
def test_outputs_match_the_resident_quantized_model(device, config):
    model = quantized_mlp(config)
    reference = unwrapped_reference(model, device)
    _wrap(model, device)
    x = torch.randn(4, 8, device=device)
    with torch.no_grad():
        expected = reference(x)
        with MasterGuard(model):  # every op reads the device twin, never a host master
            out = model(x)
    torch.testing.assert_close(out, expected, **tolerances(device))
    assert type(model.blocks[0].fc1.weight) is type(reference.blocks[0].fc1.weight)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("config", CONFIGS)
def test_input_grads_and_head_training_match(device, config):
    """Gradients flow through the quantized blocks to the trainable input layer, several steps."""
    model = quantized_mlp(config)
    reference = unwrapped_reference(model, device)
    _wrap(model, device)
    for m in (model, reference):
        m.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        x, y = torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)
        F.mse_loss(reference(x), y).backward()
        with MasterGuard(model):
            F.mse_loss(model(x), y).backward()
        torch.testing.assert_close(host(model.input.weight.grad), host(reference.input.weight.grad),
                                   **tolerances(device))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    torch.testing.assert_close(host(model.input.weight), host(reference.input.weight), **tolerances(device))
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("policy", [{"frozen_format": "int8"}, {"max_scope_bytes": 4096}],
                         ids=["frozen_format", "split_scopes"])
def test_policies_leave_the_packed_bytes_alone(policy):
    """Policy(frozen_format) does not requantize the packed parts (uint8 to it); a block split
    into scopes per child streams each linear's parts with its scope."""
    model = quantized_mlp("fp8")
    reference = unwrapped_reference(model, "cpu")
    _wrap(model, "cpu", **policy)
    x = torch.randn(4, 8)
    with torch.no_grad(), MasterGuard(model):
        out = model(x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)


def test_host_buffers_hold_the_packed_bytes_not_dequantized_values():
    model = quantized_mlp("int8")
    packed = _packed_bytes(model.blocks)
    _wrap(model, "cpu")
    engine = _find_engine(model)
    scope = engine.scopes[0]
    fc1 = model.blocks[0].fc1.weight
    # The host weight's inner tensors are views of the scope's host buffer (the masters).
    base, end = scope.masters.flat.data_ptr(), scope.masters.flat.data_ptr() + scope.masters.flat.numel()
    assert base <= fc1.qdata.data_ptr() < end and fc1.qdata.dtype == torch.int8
    # Host bytes: the packed weights plus the blocks' biases and norms, each aligned to 256.
    summary = offtensor.summary(model)
    unquantized = sum(p.numel() * p.element_size() for n, p in model.blocks.named_parameters()
                      if not hasattr(p, "__tensor_flatten__"))
    host_bytes = sum(s.host_bytes for s in summary.scopes)
    assert packed + unquantized <= host_bytes <= packed + unquantized + 3 * 10 * 256
    dequantized = sum(p.numel() * 4 for p in model.blocks.parameters() if hasattr(p, "__tensor_flatten__"))
    assert host_bytes < dequantized


def test_state_dict_and_dequantized_values_match():
    model, reference = _wrapped_int8_mlp_and_reference()
    got, expected = model.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(got[k].dequantize() if hasattr(v, "qdata") else got[k],
                                   v.dequantize() if hasattr(v, "qdata") else v, rtol=0, atol=0)


def test_unwrap_gives_the_plain_quantized_model_back():
    model = quantized_mlp("fp8")
    reference = unwrapped_reference(model, "cpu")
    _wrap(model, "cpu")
    x = torch.randn(4, 8)
    model(x)
    scope = _find_engine(model).scopes[0]
    offtensor.unwrap(model)
    w = model.blocks[0].fc1.weight
    base = scope.masters.flat.data_ptr()
    assert not base <= w.qdata.data_ptr() < base + scope.masters.flat.numel()  # own memory now
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    _wrap(model, "cpu")  # and it can be wrapped again
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_error_if_a_quantized_weight_requires_grad_at_wrap():
    model = quantized_mlp("int8")
    model.blocks[1].fc2.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"quantized parameter 'blocks\.1\.fc2\.weight' .*requires grad"):
        _wrap(model, "cpu")


def test_error_if_a_quantized_weight_is_unfrozen_after_wrap():
    model = quantized_mlp("int8")
    _wrap(model, "cpu")
    model.blocks[2].fc1.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"'blocks\.2\.fc1\.weight' requires grad.*frozen only"):
        model(torch.randn(2, 8))
    model.blocks[2].fc1.weight.requires_grad_(False)
    assert_all_scopes_offloaded(model)
    model(torch.randn(2, 8))  # usable again


def test_error_if_a_quantized_weight_is_replaced_after_wrap():
    model = quantized_mlp("int8")
    _wrap(model, "cpu")
    model.blocks[0].fc1.weight = nn.Parameter(torch.zeros(2 * HIDDEN, HIDDEN), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"'blocks\.0\.fc1\.weight' was replaced after offtensor\.wrap"):
        model(torch.randn(2, 8))


def test_dtype_conversion_is_refused_and_moves_keep_the_packed_masters_on_the_host():
    model = quantized_mlp("int8")
    _wrap(model, "cpu")
    w = model.blocks[0].fc1.weight
    with pytest.raises(TypeError, match=r"cannot convert offloaded parameter 'blocks\.0\.\w+\.weight'"):
        model.half()
    assert model.blocks[0].fc1.weight is w and w.dtype == torch.float32
    model.to("cpu")
    model.to(torch.device("cpu"))
    assert model.blocks[0].fc1.weight is w


def test_error_if_data_parallel_is_asked_for_a_model_with_quantized_weights(tmp_path):
    dist = torch.distributed
    model = quantized_mlp("int8")
    _wrap(model, "cpu")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(NotImplementedError, match=r"'blocks\.0\.fc1\.weight' is an already-quantized weight"):
            offtensor.data_parallel(model)
    finally:
        dist.destroy_process_group()


def _wrapped_int8_mlp_and_reference() -> tuple[nn.Module, nn.Module]:
    """An int8-quantized MLP wrapped on the CPU, and its unwrapped reference made first."""
    model = quantized_mlp("int8")
    reference = unwrapped_reference(model, "cpu")
    _wrap(model, "cpu")
    return model, reference


class _Boom(Exception):
    pass


def test_exception_mid_forward_puts_the_host_weights_back():
    model, reference = _wrapped_int8_mlp_and_reference()
    w = model.blocks[1].fc2.weight

    def boom(module, args, output):
        assert module.weight is not w  # the device twin while the module computes
        raise _Boom

    handle = model.blocks[1].fc2.register_forward_hook(boom, prepend=True)  # before offtensor's
    with pytest.raises(_Boom):
        model(torch.randn(2, 8))
    handle.remove()
    assert model.blocks[1].fc2.weight is w
    assert_all_scopes_offloaded(model)
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_a_forward_after_a_keyboard_interrupt_puts_the_host_weights_back():
    model, reference = _wrapped_int8_mlp_and_reference()
    w = model.blocks[0].fc1.weight

    def interrupt(module, args, output):
        raise KeyboardInterrupt  # PyTorch runs no always_call hook for it

    handle = model.blocks[0].fc1.register_forward_hook(interrupt, prepend=True)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 8))
    handle.remove()
    assert model.blocks[0].fc1.weight is not w  # the interrupted call's twin, until the next call
    x = torch.randn(2, 8)
    with torch.no_grad(), MasterGuard(model):
        out = model(x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    assert model.blocks[0].fc1.weight is w
    assert_all_scopes_offloaded(model)


def test_load_state_dict_writes_the_masters_and_the_next_forward_uses_them():
    model = quantized_mlp("int8")
    other = quantized_mlp("int8")  # other values (a different random init)
    expected = unwrapped_reference(other, "cpu")
    _wrap(model, "cpu")
    x = torch.randn(2, 8)
    with offtensor.no_offload(model):  # a device copy kept across the load must not go stale
        model(x)
        model.load_state_dict(other.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(model(x), expected(x), rtol=0, atol=0)


# ---- Hugging Face Llama with PEFT LoRA on a quantized base ---------------------------------

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def tiny_llama() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def lora_on_quantized_llama(config: str, device: str) -> nn.Module:
    model = tiny_llama().to(device)
    torchao_quant.quantize_(model, _configs()[config], filter_fn=_in_blocks)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                           init_lora_weights=False)  # B != 0: every LoRA matrix gets a gradient
    return peft.get_peft_model(model, lora)


def _train_lora(model: nn.Module, ids_batches, *, guard: bool = False,
                step_on_host: bool = False) -> tuple[torch.Tensor, dict]:
    """Train on the batches with AdamW: the losses and the last batch's gradients. With
    `step_on_host`, AdamW steps host copies of the trainable parameters, which are then copied
    back: the arithmetic of a wrapped model's step, whose masters are on the host."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    stepped = [host(p).clone() for p in trainable] if step_on_host else trainable
    opt = torch.optim.AdamW(stepped, lr=1e-2)
    losses, grads = [], {}
    for ids in ids_batches:
        if guard:
            with MasterGuard(model):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        grads = {n: host(p.grad) for n, p in model.named_parameters() if p.requires_grad}
        if step_on_host:
            for copy, p in zip(stepped, trainable, strict=True):
                copy.grad = host(p.grad).clone()
                p.grad = None
        opt.step()
        opt.zero_grad()
        if step_on_host:
            with torch.no_grad():
                for copy, p in zip(stepped, trainable, strict=True):
                    p.copy_(copy)
        losses.append(host(loss))
    return torch.stack(losses), grads


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "hf_checkpointing"])
@pytest.mark.parametrize("config", ["int8", "fp8"])
def test_lora_on_a_quantized_llama_trains_like_the_resident_model(device, checkpointing, config):
    model = lora_on_quantized_llama(config, "cpu")
    if checkpointing:
        # Hugging Face checkpoints each layer's `forward`: its recompute runs without the
        # layer's hooks, but through the quantized linears' own.
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model.train()
    reference = unwrapped_reference(model, device)
    offtensor.wrap(model, device=device)
    model.to(device)
    batches = [torch.randint(0, 128, (2, 16), device=device) for _ in range(3)]
    # The reference steps host copies of its LoRA matrices, as the wrapped model's optimizer
    # does: a GPU AdamW rounds differently in the last bits, which the fp8 model amplifies
    # beyond tolerances() one step later. The rest is the same kernels, so the two agree bit
    # for bit on each device.
    expected, ref_grads = _train_lora(reference, batches, step_on_host=True)
    losses, grads = _train_lora(model, batches, guard=device == "cpu")
    tol = {"rtol": 0.0, "atol": 0.0}
    torch.testing.assert_close(losses, expected, **tol)
    assert grads.keys() == ref_grads.keys() and any("lora_A" in n for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], msg=lambda m, name=name: f"{name}: {m}", **tol)
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(host(p), host(r), msg=lambda m, name=name: f"{name}: {m}", **tol)
    assert_all_scopes_offloaded(model)


# ---- bitsandbytes 4-bit (QLoRA) -----------------------------------------------------------


def _bnb_cpu_works() -> bool:
    try:
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float32, quant_type="nf4").to("cpu")
        layer(torch.randn(1, 64))
        return True
    except (ImportError, RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False


bnb_devices = [
    pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(not _bnb_cpu_works(),
                                                         reason="bitsandbytes 4-bit does not run on this CPU")),
    devices[1],
]


def bnb_mlp(device: str) -> nn.Module:
    """conftest's block MLP with the blocks' linears as bitsandbytes nf4 Linear4bit."""
    bnb = pytest.importorskip("bitsandbytes")
    model = mlp_of_blocks(n_blocks=3, hidden=HIDDEN)
    for block in model.blocks:
        for name in ("fc1", "fc2"):
            lin = getattr(block, name)
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=True,
                                  compute_dtype=torch.float32, quant_type="nf4")
            q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4")
            q.bias = nn.Parameter(lin.bias.data.clone())
            setattr(block, name, q)
    return model.to(device)  # quantizes


@pytest.mark.parametrize("device", bnb_devices)
def test_bnb_4bit_qlora_matches_the_resident_model(device):
    model = bnb_mlp(device)
    for p in model.parameters():
        p.requires_grad_(False)
    lora = peft.LoraConfig(r=4, target_modules=["fc1", "fc2"], init_lora_weights=False)
    model = peft.get_peft_model(model, lora)
    reference = unwrapped_reference(model, device)
    w = model.base_model.model.blocks[0].fc1.base_layer.weight
    host_before = w.quant_state.absmax
    offtensor.wrap(model, device=device)
    model.to(device)
    assert w.quant_state.absmax is not host_before and w.device.type == "cpu"
    tol = tolerances(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        x, y = torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)
        F.mse_loss(reference(x), y).backward()
        with MasterGuard(model):  # the packed bytes and scales the kernels read are device copies
            F.mse_loss(model(x), y).backward()
        for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
            if p.requires_grad:
                torch.testing.assert_close(host(p.grad), host(r.grad), msg=lambda m, n=name: f"{n}: {m}", **tol)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    with torch.no_grad():
        x = torch.randn(4, 8, device=device)
        torch.testing.assert_close(model(x), reference(x), **tol)
    assert_all_scopes_offloaded(model)
    sd, ref_sd = model.state_dict(), reference.state_dict()
    assert sd.keys() == ref_sd.keys()
    for k in ref_sd:
        if isinstance(ref_sd[k], torch.Tensor):
            # The packed bytes and quantization state exactly; trained weights within the
            # device's tolerance (CUDA kernels of the two models may sum in other orders).
            exact = not ref_sd[k].is_floating_point() or not reference.get_parameter(k).requires_grad \
                if k in dict(reference.named_parameters()) else True
            torch.testing.assert_close(host(sd[k]), host(ref_sd[k]), **({"rtol": 0, "atol": 0} if exact else tol))


# ---- CUDA: the packed bytes are what is offloaded and copied ----------------------------------


def _cuda_quantized(config: str) -> nn.Module:
    if config == "int4":  # Int4WeightOnlyConfig: CUDA only (tinygemm's tile-packed layout), bf16
        model = mlp_of_blocks(n_blocks=3, hidden=256).to(torch.bfloat16).cuda()
        from torchao.quantization.quantize_.workflows import Int4PackingFormat

        cfg = torchao_quant.Int4WeightOnlyConfig(group_size=64, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D)
        torchao_quant.quantize_(model, cfg, filter_fn=_in_blocks)
        return model
    return quantized_mlp(config, "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", ["int8", "fp8", "int4"])
def test_cuda_packed_bytes_are_offloaded_and_streamed(config):
    model = _cuda_quantized(config)
    reference = copy.deepcopy(model)
    dtype = next(model.input.parameters()).dtype
    x = torch.randn(4, 8, device="cuda", dtype=dtype)
    with torch.no_grad():
        expected = reference(x)
    packed = _packed_bytes(model.blocks)
    del reference
    torch.cuda.synchronize()
    # Measured once the model is on the device and has run (so cuBLAS workspaces and the like
    # already exist): wrapping must take at least the blocks' packed bytes off the device.
    before = torch.cuda.memory_allocated()
    offtensor.wrap(model, device="cuda")
    model.to("cuda")
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    assert before - baseline >= packed, f"wrap freed {before - baseline} bytes of the device, the blocks hold {packed}"
    seen = []

    def device_bytes(module, args, output):
        engine = _find_engine(model)
        scope = next(s for s in engine.scopes if s.module is module)
        seen.append((scope.device.storage.nbytes(), scope.device.nbytes, scope.masters.nbytes))

    # prepend: before offtensor's own forward hook, which releases the scope.
    handles = [b.register_forward_hook(device_bytes, prepend=True) for b in model.blocks]
    with torch.no_grad():
        out = model(x)
    for h in handles:
        h.remove()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    del out
    assert torch.cuda.memory_allocated() == baseline  # nothing left on the device
    assert len(seen) == len(model.blocks)
    # What each load moved is the scope's layout of the packed bytes (plus biases and norms),
    # host and device alike: not the dequantized weights.
    dequantized = sum(p.numel() * 2 for p in model.blocks.parameters()  # even in bf16
                      if hasattr(p, "__tensor_flatten__"))
    for storage, device_nbytes, host_nbytes in seen:
        assert storage == device_nbytes == host_nbytes
    assert sum(s[1] for s in seen) < dequantized
    assert sum(s[1] for s in seen) >= packed
