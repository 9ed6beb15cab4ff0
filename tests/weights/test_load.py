"""offtensor.load: a model built on the meta device, its masters filled scope by scope from a
safetensors checkpoint (sharded or not) or an init function (Note [loading scope by scope] in
model/load.py), compared with the same model loaded normally."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import devices, tolerances

import offtensor
from offtensor.storage.compress import MIN_NUMEL, quantize_dequantize

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")


def _config(tied: bool = False):
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                    tie_word_embeddings=tied)


def _saved(tmp_path: Path, tied: bool = False, shard: str | None = "60KB"):
    model = transformers.LlamaForCausalLM(_config(tied)).to(torch.bfloat16).eval()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    return model


def _meta_model(tied: bool = False):
    with accelerate.init_empty_weights():  # parameters on meta; buffers (rotary inv_freq) real
        model = transformers.LlamaForCausalLM(_config(tied)).to(torch.bfloat16)
    return model.eval()


def _ids(device: str) -> torch.Tensor:
    return torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0)).to(device)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "one-file"])
@pytest.mark.parametrize("device", devices)
def test_load_from_a_checkpoint_matches_the_model_loaded_normally(tmp_path, device, sharded, tied):
    reference = _saved(tmp_path, tied=tied, shard="60KB" if sharded else None).to(device)
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    model = _meta_model(tied)
    offtensor.load(model, tmp_path, device=device)
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert offtensor.summary(model).scopes and len(offtensor.summary(model).scopes) == 3
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == torch.device(device).type  # the rest: on the device
    with torch.no_grad():
        got, expected = model(_ids(device)).logits, reference(_ids(device)).logits
    torch.testing.assert_close(got, expected, **tolerances(device, torch.bfloat16))
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), r.detach().cpu()), name


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("device", devices)
def test_load_compresses_frozen_weights_on_the_fly(tmp_path, device, fmt):
    reference = _saved(tmp_path)
    with torch.no_grad():
        for p in reference.model.layers.parameters():
            if p.dim() >= 2 and p.numel() >= MIN_NUMEL:
                p.copy_(quantize_dequantize(p, fmt))
    reference.to(device)
    model = _meta_model().requires_grad_(False)
    offtensor.load(model, tmp_path, device=device, policy=offtensor.Policy(frozen_format=fmt))
    with torch.no_grad():
        got, expected = model(_ids(device)).logits, reference(_ids(device)).logits
    torch.testing.assert_close(got, expected, **tolerances(device, torch.bfloat16))


def _init(name: str, module: torch.nn.Module) -> None:
    """Deterministic per-parameter values, whatever the order or device of the calls."""
    for pname, p in module.named_parameters(recurse=False):
        gen = torch.Generator().manual_seed(sum(map(ord, f"{name}.{pname}")))
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("device", devices)
def test_load_with_an_init_function_fills_each_scope(device):
    reference = transformers.LlamaForCausalLM(_config()).to(torch.bfloat16).eval()
    for name, module in reference.named_modules():
        _init(name, module)
    reference.to(device)
    model = _meta_model()
    calls = []
    offtensor.load(model, init=lambda n, m: (calls.append(n), _init(n, m)), device=device)
    assert "model.layers.0.self_attn.q_proj" in calls and "model.embed_tokens" in calls
    with torch.no_grad():
        torch.testing.assert_close(model(_ids(device)).logits, reference(_ids(device)).logits,
                                   **tolerances(device, torch.bfloat16))


@pytest.mark.parametrize("fmt", ["fp8", "int8", None], ids=["fp8", "int8", "bf16"])
@pytest.mark.parametrize("init_device", devices)
def test_an_init_on_the_device_gives_the_same_masters_as_on_the_cpu(init_device, fmt):
    """init_device: the scope's parameters are initialized there and compressed there (only
    the 1-byte values and scales cross to the host): the same bytes as the CPU path."""
    policy = offtensor.Policy(frozen_format=fmt)
    loaded = {}
    for where in ("cpu", init_device):
        model = _meta_model().requires_grad_(False)
        devices_seen = set()

        def init(name, module):
            devices_seen.update(p.device.type for p in module.parameters(recurse=False))
            _init(name, module)

        offtensor.load(model, init=init, device="cpu", policy=policy, init_device=where)
        assert "cpu" in devices_seen and (where == "cpu" or where in devices_seen)  # the rest: on the CPU
        loaded[where] = {k: v.clone() for k, v in model.state_dict().items()}
        for p in model.parameters():
            assert p.device.type == "cpu"
    for key, value in loaded["cpu"].items():
        assert torch.equal(loaded[init_device][key], value), key


def test_load_puts_the_rest_where_asked(tmp_path):
    _saved(tmp_path)
    model = _meta_model()
    offtensor.load(model, tmp_path, device="cpu", rest_device="cpu")
    assert model.model.embed_tokens.weight.device.type == "cpu"
    assert not isinstance(model.model.embed_tokens.weight, offtensor.OffloadedParameter)


def test_load_errors_name_the_tensor_and_the_fix(tmp_path):
    _saved(tmp_path, shard=None)
    with pytest.raises(ValueError, match="pass weights= .* or init="):
        offtensor.load(_meta_model())
    with pytest.raises(FileNotFoundError, match="not a safetensors checkpoint"):
        offtensor.load(_meta_model(), tmp_path / "nowhere")
    model = _meta_model()
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(128, 32, bias=False, device="meta")
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.down_proj.weight' has shape \(64, 128\), but "
                                         r"parameter 'model.layers.1.mlp.down_proj.weight' .* \(32, 128\)"):
        offtensor.load(model, tmp_path)
    model = _meta_model()
    model.model.layers[2].extra = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(KeyError, match="no tensor for parameter 'model.layers.2.extra.weight'.*pass init="):
        offtensor.load(model, tmp_path)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_config())  # buffers on meta too
    with pytest.raises(KeyError, match="buffer 'model.rotary_emb.inv_freq' is on the meta device.*init_empty_weights"):
        offtensor.load(model, tmp_path, device="cpu")
    with pytest.raises(ValueError, match="is on the meta device .*offtensor.load"):
        offtensor.wrap(_meta_model())


def test_load_with_a_peft_model_finds_the_base_weights(tmp_path):
    peft = pytest.importorskip("peft")
    reference = _saved(tmp_path)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    gen = torch.manual_seed(3)
    reference = peft.get_peft_model(reference, lora)
    model = peft.get_peft_model(_meta_model(), copy.deepcopy(lora))

    def init(name, module):  # the adapters: the reference's values
        for pname, p in module.named_parameters(recurse=False):
            with torch.no_grad():
                p.copy_(reference.get_parameter(f"{name}.{pname}"))

    del gen
    policy = offtensor.Policy(param_filter=offtensor.frozen_only)
    offtensor.load(model, tmp_path, init=init, device="cpu", policy=policy)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids("cpu")).logits, reference(_ids("cpu")).logits, rtol=0, atol=0)



class _Block(torch.nn.Module):
    """A linear, a batch norm and a persistent buffer of its own."""

    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(h, h)
        self.norm = torch.nn.BatchNorm1d(h)
        self.register_buffer("gain", torch.ones(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x)) * self.gain


class _EncoderDecoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.ModuleList(_Block() for _ in range(2))
        self.decoder = torch.nn.ModuleList(_Block() for _ in range(2))
        self.norm = torch.nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.encoder, *self.decoder]:
            x = block(x)
        return self.norm(x)


def _is_block(name: str, module: torch.nn.Module) -> bool:
    return isinstance(module, _Block)


def _save(module: torch.nn.Module, path: Path, prefix: str = "") -> None:
    from safetensors.torch import save_file

    save_file({prefix + k: v.contiguous() for k, v in module.state_dict().items()}, path)


def _trained_encoder_decoder() -> torch.nn.Module:
    """Random weights and batch-norm statistics, so that a buffer left at its default shows."""
    model = _EncoderDecoder().eval()
    gen = torch.Generator().manual_seed(0)
    for module in model.modules():
        for b in module.buffers(recurse=False):
            if b.is_floating_point():
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
    return model


def test_load_fills_persistent_buffers_that_init_empty_weights_keeps_real(tmp_path):
    """init_empty_weights (the documented way to build the model) keeps buffers real: a
    batch norm's running statistics and other persistent buffers must still come from the
    checkpoint, in the scopes and outside them, as load_state_dict gives them."""
    reference = _trained_encoder_decoder()
    _save(reference, tmp_path / "model.safetensors")
    with accelerate.init_empty_weights():
        model = _EncoderDecoder().eval()
    offtensor.load(model, tmp_path, _is_block, device="cpu")
    for name, b in reference.named_buffers():
        assert torch.equal(model.get_buffer(name), b), name
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def _save_without(module: torch.nn.Module, path: Path, left_out: set[str]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in module.state_dict().items() if k not in left_out}, path)


# Left out of the checkpoint: a scope's buffers (a batch norm's running mean, a buffer of the
# block's own) or the rest's (the final norm's statistics).
_LEFT_OUT = {"scope": ["decoder.1.gain", "decoder.1.norm.running_mean"],
             "rest": ["norm.running_mean", "norm.running_var"]}


@pytest.mark.parametrize("where", ["scope", "rest"])
def test_load_raises_naming_the_persistent_buffers_a_checkpoint_lacks(tmp_path, where):
    """Regression: a real persistent buffer (init_empty_weights keeps buffers real) that the
    checkpoint lacked kept the value the model was built with, without a word, where
    load_state_dict raises "Missing key(s)": batch-norm statistics at their defaults gave
    another output in eval. Now refused before anything is loaded."""
    reference = _trained_encoder_decoder()
    left_out = _LEFT_OUT[where]
    _save_without(reference, tmp_path / "model.safetensors", set(left_out))
    with pytest.raises(RuntimeError, match="Missing key"):
        copy.deepcopy(reference).load_state_dict(
            {k: v for k, v in reference.state_dict().items() if k not in left_out})
    with accelerate.init_empty_weights():
        model = _EncoderDecoder().eval()
    names = re.escape(", ".join(repr(k) for k in left_out))
    with pytest.raises(KeyError, match=rf"the checkpoint has no tensor for 2 persistent buffers \({names}\): "
                                       r"they would keep the values the model was built with.*pass strict=False"):
        offtensor.load(model, tmp_path, _is_block, device="cpu")
    assert not offtensor.is_wrapped(model)
    assert all(p.is_meta for p in model.parameters())
    with pytest.warns(UserWarning, match="no tensor for 2 persistent buffers"):  # a retry loads
        offtensor.load(model, tmp_path, _is_block, device="cpu", strict=False)


@pytest.mark.parametrize("where", ["scope", "rest"])
def test_load_with_strict_false_warns_naming_the_buffers_a_checkpoint_lacks_and_keeps_their_values(
        tmp_path, where):
    """As load_state_dict(strict=False): the buffers the checkpoint lacks keep the values the
    model was built with, every other tensor comes from the checkpoint."""
    reference = _trained_encoder_decoder()
    left_out = _LEFT_OUT[where]
    _save_without(reference, tmp_path / "model.safetensors", set(left_out))
    built = _EncoderDecoder()
    with torch.no_grad():
        for name in left_out:
            reference.get_buffer(name).copy_(built.get_buffer(name))
    with accelerate.init_empty_weights():
        model = _EncoderDecoder().eval()
    names = re.escape(", ".join(repr(k) for k in left_out))
    with pytest.warns(UserWarning, match=rf"the checkpoint has no tensor for 2 persistent buffers \({names}\): "
                                         r"they keep the values the model was built with \(strict=False\)"):
        offtensor.load(model, tmp_path, _is_block, device="cpu", strict=False)
    for name, b in reference.named_buffers():
        assert torch.equal(model.get_buffer(name), b), name
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_load_refuses_checkpoint_keys_that_match_only_under_different_prefixes(tmp_path):
    """Dropping leading components of a parameter's name (PEFT's `base_model.model.`) must drop
    the same ones for every parameter: a checkpoint of the decoder alone (`0.fc.weight`) must not
    fill the encoder's `encoder.0.fc.weight` and the decoder's `decoder.0.fc.weight` alike."""
    decoder = _trained_encoder_decoder().decoder
    _save(decoder, tmp_path / "decoder.safetensors")
    with torch.device("meta"):
        model = _EncoderDecoder()
    with pytest.raises(ValueError, match=r"'decoder.0.fc.weight' .*key '0.fc.weight', dropping 'decoder.', but "
                                         r"'encoder.0.fc.weight' .*key '0.fc.weight', dropping 'encoder.'"):
        offtensor.load(model, tmp_path / "decoder.safetensors", _is_block, device="cpu", init=lambda n, m: None)
    # One prefix for every key (a checkpoint of the model with a wrapper's prefix) still loads.
    reference = _trained_encoder_decoder()
    with accelerate.init_empty_weights():
        outer = torch.nn.Module()
        outer.base = torch.nn.Module()
        outer.base.inner = _EncoderDecoder().eval()
    _save(reference, tmp_path / "model.safetensors")
    offtensor.load(outer, tmp_path / "model.safetensors", _is_block, device="cpu")
    for name, t in reference.state_dict().items():
        assert torch.equal(outer.base.inner.state_dict()[name], t), name


def test_load_warns_naming_the_checkpoint_tensors_it_did_not_load(tmp_path):
    """With init= every parameter the checkpoint lacks is initialized, so a checkpoint whose keys
    match nothing (another architecture, another prefix) gave a randomly initialized model without
    a word: the tensors left unused are named, as from_pretrained's unexpected keys are."""
    reference = _trained_encoder_decoder()
    _save(reference, tmp_path / "model.safetensors", prefix="transformer.")
    with torch.device("meta"):
        model = _EncoderDecoder()
    with pytest.warns(UserWarning, match=r"did not load 37 of the checkpoint's 37 tensors "
                                         r"\('transformer.decoder.0.fc.bias'"):
        offtensor.load(model, tmp_path, _is_block, device="cpu", init=lambda n, m: None)
    _save(reference, tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = _EncoderDecoder()
    model.extra = torch.nn.Linear(2, 2, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # everything used: no warning
        offtensor.load(model, tmp_path, _is_block, device="cpu", init=lambda n, m: None)


_RSS_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from torch import nn
    import offtensor

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    class Stack(nn.Module):
        def __init__(self, n, h):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(h, 2 * h, bias=False),
                                                      nn.Linear(2 * h, h, bias=False)) for _ in range(n))

    path, n, h, fmt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    with torch.device("meta"):
        model = Stack(n, h).to(torch.bfloat16).requires_grad_(False)
    open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current RSS
    before = rss("VmRSS:")
    policy = offtensor.Policy(frozen_format=None if fmt == "none" else fmt)
    offtensor.load(model, path, device="cpu", policy=policy)
    peak = rss("VmHWM:")
    device_scope = max(s.device.nbytes for s in offtensor.engine.engine.find_engine(model).scopes)
    print(json.dumps({"growth": peak - before, "host": offtensor.summary(model).host_bytes,
                      "device_scope": device_scope}))
""")


@pytest.mark.full_tier  # a subprocess per format: the full tier runs it
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak RSS reset")
@pytest.mark.parametrize("fmt", ["fp8", "none"])
def test_peak_host_memory_of_a_load_stays_near_the_offloaded_bytes(tmp_path, fmt):
    """In a fresh process: peak RSS growth while loading a 16-layer, 128 MiB bf16 checkpoint.

    With device="cpu" the scope being built also allocates its "device" buffer in host memory
    (on a GPU that is device memory): one scope's device bytes are taken off the growth. glibc
    keeps freed blocks above its dynamic mmap threshold in its heap for reuse, which RSS counts
    while nothing uses them; the threshold is fixed so that the peak measures live memory."""
    from safetensors.torch import save_file

    n, h = 16, 1024
    tensors = {f"layers.{i}.{j}.weight": torch.randn(*((2 * h, h) if j == 0 else (h, 2 * h))).bfloat16()
               for i in range(n) for j in range(2)}
    save_file(tensors, tmp_path / "model.safetensors")
    del tensors
    script = tmp_path / "measure.py"
    script.write_text(_RSS_SCRIPT)
    root = str(Path(offtensor.__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "model.safetensors"), str(n), str(h), fmt],
                         capture_output=True, text=True, env=env, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    growth = result["growth"] - result["device_scope"]
    ratio = growth / result["host"]
    print(f"{fmt}: peak RSS growth {growth / 2**20:.1f} MiB (less one scope's device buffer) for "
          f"{result['host'] / 2**20:.1f} MiB of masters ({ratio:.3f}x)")
    assert ratio <= 1.15


def _embedding_and_layers(name: str, module: torch.nn.Module) -> bool:
    return name.endswith("model.embed_tokens") or re.fullmatch(r"(.*\.)?model\.layers\.\d+", name) is not None


@pytest.mark.parametrize("init_device", [None, *devices], ids=lambda d: f"init_{d}")
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("device", devices)
def test_load_of_a_compressed_qwen2_with_a_tied_embedding_and_adapters_matches_from_pretrained(
        tmp_path, device, fmt, init_device):
    """A non-Llama architecture (Qwen2: q, k, v biases) saved by save_pretrained in several
    shards, its tied embedding and head a compressed scope of its own, PEFT adapters filled by
    init (on init_device): every parameter equals the model loaded by from_pretrained with its
    compressed matrices quantized the same way, and so do the logits, exactly on the CPU."""
    peft = pytest.importorskip("peft")
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "up_proj"], init_lora_weights=False)
    reference = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    reference = peft.get_peft_model(reference, lora).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if (".layers." in name or "embed_tokens" in name) and p.dim() >= 2 and p.numel() >= MIN_NUMEL \
                    and not p.requires_grad:
                p.copy_(quantize_dequantize(p, fmt))
    with accelerate.init_empty_weights():
        model = transformers.Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16)  # buffers fp32
    model = peft.get_peft_model(model, copy.deepcopy(lora)).eval()

    initialized = []

    def init(name, module):  # the adapters only: the reference's values
        initialized.append(name)
        for pname, p in module.named_parameters(recurse=False):
            if ".lora_" in f"{name}.":
                with torch.no_grad():
                    p.copy_(reference.get_parameter(f"{name}.{pname}"))

    offtensor.load(model, tmp_path, _embedding_and_layers, init=init, device=device, init_device=init_device,
                   policy=offtensor.Policy(frozen_format=fmt))
    embed = model.base_model.model.model.embed_tokens.weight
    assert model.base_model.model.lm_head.weight is embed and embed._ot.packed is not None
    assert len(offtensor.summary(model).scopes) == 4
    assert initialized and all(".lora_" in name for name in initialized)  # the rest: from the checkpoint
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert p.requires_grad == r.requires_grad and torch.equal(p.detach().cpu(), r.detach()), name
    reference.to(device)
    with torch.no_grad():
        got, expected = model(input_ids=_ids(device)).logits, reference(input_ids=_ids(device)).logits
    torch.testing.assert_close(got, expected, **tolerances(device, torch.bfloat16))


@pytest.mark.parametrize("where", ["init of a scope", "checkpoint of a scope", "init of the rest"])
def test_a_load_that_raises_leaves_the_model_as_it_was_and_a_retry_loads_it(tmp_path, where):
    """Regression: an error in the second scope (an init that raised, a tensor of the wrong shape)
    left the first scope offloaded and hooked and the second's parameters allocated but never
    initialized: a retry was refused ("already offloaded"), and after unwrap a retry kept the
    uninitialized values (Note [a wrap that raised] in wrapping.py)."""
    reference = _saved(tmp_path, shard=None)
    model = _meta_model()
    failing = {"init of a scope": "model.layers.1.mlp.up_proj", "init of the rest": "lm_head"}.get(where)

    def init(name, module):
        if name == failing:
            raise KeyError("init failed")
        _init(name, module)

    if where == "checkpoint of a scope":
        weights, match, wrong = tmp_path, "has shape", model.model.layers[1].mlp
        wrong.down_proj = torch.nn.Linear(128, 32, bias=False, device="meta", dtype=torch.bfloat16)
    else:
        weights, match = None, "init failed"
    with pytest.raises((KeyError, ValueError), match=match):
        offtensor.load(model, weights, init=init, device="cpu")
    assert not offtensor.is_wrapped(model)
    assert not any(hasattr(m, "_offtensor_engine") or m._forward_pre_hooks for m in model.modules())
    assert all(p.is_meta and type(p) is torch.nn.Parameter for p in model.parameters())
    if where == "checkpoint of a scope":
        wrong.down_proj = torch.nn.Linear(128, 64, bias=False, device="meta", dtype=torch.bfloat16)
        offtensor.load(model, tmp_path, device="cpu")
    else:
        offtensor.load(model, init=_init, device="cpu")
        reference = transformers.LlamaForCausalLM(_config()).to(torch.bfloat16).eval()
        for name, module in reference.named_modules():
            _init(name, module)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids("cpu")).logits, reference(_ids("cpu")).logits)


def _mixed_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Tensors of several dtypes and shapes (a scalar, an empty one, one of many read pieces)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "0.weight": torch.randn(64, 48, generator=gen).bfloat16(),
        "0.bias": torch.randn(64, generator=gen).half(),
        "1.weight": torch.randn(300, 70, generator=gen),
        "1.bias": torch.randint(-100, 100, (300,), generator=gen, dtype=torch.int32).float(),
        "2.scale": torch.tensor(1.5),
        "2.empty": torch.zeros(0, 5),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    return path, tensors


class _Mixed(torch.nn.Module):
    def __init__(self, dtypes: dict[str, torch.dtype]) -> None:
        super().__init__()
        shapes = {"0.weight": (64, 48), "0.bias": (64,), "1.weight": (300, 70), "1.bias": (300,),
                  "2.scale": (), "2.empty": (0, 5)}
        self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(3))
        for key, shape in shapes.items():
            i, name = key.split(".")
            with torch.device("meta"):
                setattr(self.layers[int(i)], name, torch.nn.Parameter(torch.empty(shape, dtype=dtypes.get(key, {
                    "0.weight": torch.bfloat16, "0.bias": torch.float16}.get(key, torch.float32)))))


@pytest.mark.parametrize("convert", [False, True], ids=["file-dtypes", "converted"])
def test_load_reads_each_tensor_bit_for_bit_mapped_read_or_converted(tmp_path, monkeypatch, convert):
    """A master of the file's dtype is copied straight into the host buffer, from a mapping of
    its bytes when it has 4 KiB or more (here; 1 MiB by default), else with a pread; one of
    another dtype is read a block of rows at a time and converted as `tensor.to` converts it."""
    from offtensor.storage import files

    monkeypatch.setattr(files, "_MAP_AT_LEAST", 4096)
    path, tensors = _mixed_checkpoint(tmp_path)
    dtypes = {"1.weight": torch.float64, "0.weight": torch.float32} if convert else {}
    model = _Mixed(dtypes)
    offtensor.load(model, path, lambda name, m: name.startswith("layers."), device="cpu")
    for key, expected in tensors.items():
        i, name = key.split(".")
        got = getattr(model.layers[int(i)], name).detach()
        assert got.dtype == dtypes.get(key, expected.dtype)
        assert torch.equal(got, expected.to(got.dtype)), key


class _FakeTerminal:
    """stderr as a terminal."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal, setting, shown", [(True, None, True), (False, None, False), (True, "0", False)],
                         ids=["terminal", "not-a-terminal", "OFFTENSOR_PROGRESS=0"])
def test_a_progress_bar_shows_on_a_terminal_unless_turned_off(tmp_path, monkeypatch, capsys, terminal, setting,
                                                              shown):
    from offtensor.model import progress

    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)  # as if each scope took long
    if setting is None:
        monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    else:
        monkeypatch.setenv(progress.PROGRESS_ENV, setting)
    fake = _FakeTerminal()
    if terminal:
        monkeypatch.setattr(sys, "stderr", fake)
    path, _ = _mixed_checkpoint(tmp_path)
    offtensor.load(_Mixed({}), path, lambda name, m: name.startswith("layers."), device="cpu")
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    offtensor.wrap(plain, lambda name, m: isinstance(m, torch.nn.Linear), device="cpu")
    printed = fake.text + capsys.readouterr().err
    if shown:
        assert "offtensor: loading weights into host memory [" in printed, printed
        assert "offtensor: copying masters to host memory [" in printed, printed
        assert "100%" in printed and printed.endswith("\n")
    else:
        assert "offtensor:" not in printed, printed
