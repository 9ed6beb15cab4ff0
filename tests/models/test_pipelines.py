"""offtensor.wrap of a diffusers pipeline (Note [wrapping a pipeline] in components.py) and the one
VRAM budget across its components (Note [one budget across models] in budget/shared.py): a tiny
FluxPipeline built from configs with random weights, its tokenizers word-level ones built in
memory (no download), checked bit for bit against the unwrapped pipeline with the same seed."""

from __future__ import annotations

import types

import pytest
import torch
from conftest import mlp_of_blocks
from torch import nn

import offtensor
from offtensor.budget.layout import Member, ScopeCost, choose_across, simulate
from offtensor.dispatch.param import OffloadedParameter

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

STEPS = 3


def _tokenizer(max_length: int):
    words = "a photo of cat dog red blue".split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                                unk_token="<unk>", model_max_length=max_length)


def flux_pipeline():
    """Transformer (2 double-stream, 3 single-stream blocks) and T5 (3 blocks) hold most of the
    bytes; the CLIP text encoder and the VAE little. Same weights at every call."""
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=3, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, pad_token_id=0, vocab_size=100, hidden_act="gelu", projection_dim=32,
        max_position_embeddings=77))
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=37, num_layers=3, num_heads=4, decoder_start_token_id=0))
    vae = diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
        latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035, down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",))
    for module in (transformer, clip, t5, vae):
        module.eval()  # as from_pretrained leaves them: T5's dropout off
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), text_encoder=clip, tokenizer=_tokenizer(77),
        text_encoder_2=t5, tokenizer_2=_tokenizer(16), transformer=transformer, vae=vae)


def generate(pipe, prompt: str = "a photo of a cat") -> torch.Tensor:
    return pipe(prompt, height=16, width=16, num_inference_steps=STEPS, guidance_scale=3.5,
                max_sequence_length=16, output_type="pt", generator=torch.Generator().manual_seed(0)).images


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    return generate(flux_pipeline())


def _offloaded(module: nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters() if isinstance(p, OffloadedParameter)]


def _scope_bytes(pipe) -> int:
    return sum(s.device.nbytes for m in pipe._offtensor_components.shared.members for s in m.scopes)


def _device_bytes_at_each_block(pipe) -> list[int]:
    """The device bytes of every component's scopes as each block starts, for a bound."""
    seen: list[int] = []
    for module in (pipe.transformer, pipe.text_encoder_2):
        for block in [m for name, m in module.named_modules() if name.count(".") in (1, 2) and name[-1].isdigit()]:
            block.register_forward_pre_hook(lambda *_: seen.append(offtensor.summary(pipe).device_bytes))
    return seen


def test_wrapped_pipeline_makes_the_unwrapped_images_with_the_same_components(reference):
    pipe = flux_pipeline()
    components = dict(pipe.components)
    assert offtensor.wrap(pipe, device="cpu") is pipe
    assert all(pipe.components[name] is module for name, module in components.items())
    assert _offloaded(pipe.transformer) and _offloaded(pipe.text_encoder_2)
    assert not _offloaded(pipe.vae) and not _offloaded(pipe.text_encoder)  # small: whole on the device
    names = [s.name for s in offtensor.summary(pipe).scopes]
    assert names[:3] == [f"text_encoder_2.encoder.block.{i}" for i in range(3)]
    assert "transformer.single_transformer_blocks.2" in names and len(names) == 8
    for _ in range(2):
        torch.testing.assert_close(generate(pipe), reference, rtol=0, atol=0)
    assert offtensor.is_wrapped(pipe)


@pytest.mark.parametrize("layout", ["timed", "spread"])
def test_one_budget_spans_the_components_and_images_stay_equal(reference, layout):
    pipe = flux_pipeline()
    budget = 520_000  # the transformer's streaming room (3 of its 153,600-byte blocks) and 59 kB kept
    offtensor.wrap(pipe, device="cpu", policy=offtensor.Policy(vram_budget=budget, layout=layout))
    shared = pipe._offtensor_components.shared
    assert [len(m.scopes) for m in shared.members] == [3, 5]  # T5's and the transformer's engines, one budget
    assert _scope_bytes(pipe) > budget
    seen = _device_bytes_at_each_block(pipe)
    for call in range(3):
        torch.testing.assert_close(generate(pipe), reference, rtol=0, atol=0)
        lay = offtensor.summary(pipe).layout
        assert lay is not None and lay.budget == budget and 0 < lay.kept_bytes <= budget - shared.streaming_need()
        # Timed: chosen at the second call's first denoising step, once T5 ran twice.
        assert lay.timed is (layout == "timed" and call >= 1)
    assert seen and max(seen) <= budget
    if layout == "timed":
        assert shared.weights() == [1, STEPS]  # per call: T5 once, the transformer at each step


def test_auto_budget_on_a_device_without_memory_to_size_keeps_streaming(reference):
    pipe = flux_pipeline()
    offtensor.wrap(pipe, device="cpu", policy=offtensor.Policy(vram_budget="auto"))
    for _ in range(3):
        torch.testing.assert_close(generate(pipe), reference, rtol=0, atol=0)
    lay = offtensor.summary(pipe).layout
    need = pipe._offtensor_components.shared.streaming_need()  # 3 of the transformer's largest blocks
    assert need == 3 * max(s.device.nbytes for s in pipe._offtensor_components.shared.members[1].scopes)
    assert lay is not None and lay.timed and lay.budget == need and lay.kept_bytes == 0


def test_choose_across_keeps_the_scopes_of_the_model_that_runs_most():
    """Equal scopes, each copying 4x longer than it computes: one model runs once per cycle (a text
    encoder), the other 28 times (a denoiser). The kept bytes go to the second, not half to each."""
    def member(weight: int) -> Member:
        return Member([ScopeCost(1.0, 0.0, 4.0, 100, str(i)) for i in range(6)], list(range(6)), [], weight)

    text, denoiser = member(1), member(28)
    by_bytes = [{0}, {0, 3}]  # 3 of 6 scopes: 600 bytes less 3 blocks' room
    kept, pred = choose_across([text, denoiser], 600, prefetch=1, byte_layout=by_bytes)
    assert kept[0] == set() and len(kept[1]) == 3
    room = 600 - 300

    def cycle(kept_text: set[int], kept_denoiser: set[int]) -> float:
        return (simulate(text.costs, text.forward, [], kept_text, room).forward_ms
                + 28 * simulate(denoiser.costs, denoiser.forward, [], kept_denoiser, room).forward_ms)

    assert pred.forward_ms == pytest.approx(cycle(*kept))
    assert pred.forward_ms < 0.9 * cycle(*by_bytes)
    # With room for 7: the denoiser's 6th scope's copy hides behind the 5 kept ones' compute, so
    # the other 2 go to the text encoder.
    kept, _ = choose_across([text, denoiser], 1000, prefetch=1, byte_layout=by_bytes)
    assert len(kept[1]) == 5 and len(kept[0]) == 2


def test_a_budget_below_what_streaming_the_components_needs_is_refused():
    pipe = flux_pipeline()
    with pytest.raises(ValueError, match=r"vram_budget=.*below what streaming needs"):
        offtensor.wrap(pipe, device="cpu", policy=offtensor.Policy(vram_budget=400_000))
    assert not offtensor.is_wrapped(pipe) and not _offloaded(pipe.transformer) and not _offloaded(pipe.text_encoder_2)


def test_unwrap_restores_plain_parameters_and_the_images(reference):
    pipe = flux_pipeline()
    params = {id(p) for p in pipe.transformer.parameters()}
    offtensor.wrap(pipe, device="cpu", policy=offtensor.Policy(vram_budget=520_000))
    generate(pipe)
    assert offtensor.unwrap(pipe) is pipe
    assert not offtensor.is_wrapped(pipe)
    assert not any(_offloaded(m) for m in (pipe.transformer, pipe.text_encoder_2))
    assert {id(p) for p in pipe.transformer.parameters()} == params
    torch.testing.assert_close(generate(pipe), reference, rtol=0, atol=0)
    offtensor.wrap(pipe, device="cpu")  # and can be wrapped again
    torch.testing.assert_close(generate(pipe), reference, rtol=0, atol=0)


def test_predicate_sees_the_component_name_in_front(reference):
    pipe = flux_pipeline()
    seen: list[str] = []

    def select(name: str, module: nn.Module) -> bool:
        seen.append(name)
        return name.startswith("transformer.single_transformer_blocks.") and name.count(".") == 2

    offtensor.wrap(pipe, select, device="cpu")
    assert "vae.decoder" in seen and "text_encoder_2" in seen
    assert [s.name for s in offtensor.summary(pipe).scopes] == [
        f"transformer.single_transformer_blocks.{i}" for i in range(3)]
    torch.testing.assert_close(generate(pipe), reference, rtol=0, atol=0)


def test_any_object_holding_models_is_wrapped_by_its_attributes():
    torch.manual_seed(0)
    holder = types.SimpleNamespace(first=mlp_of_blocks(3, out_features=8), second=mlp_of_blocks(3), name="x")
    x = torch.randn(2, 8)
    expected = holder.second(holder.first(x))
    offtensor.wrap(holder, device="cpu")
    torch.testing.assert_close(holder.second(holder.first(x)), expected, rtol=0, atol=0)
    assert [s.name.split(".")[0] for s in offtensor.summary(holder).scopes] == ["first"] * 3 + ["second"] * 3
    offtensor.unwrap(holder)
    assert not _offloaded(holder.first) and not _offloaded(holder.second)


def test_errors_for_objects_with_nothing_to_wrap():
    with pytest.raises(TypeError, match=r"offtensor.wrap: expected an nn.Module or an object holding nn.Modules.*"
                                        r"got SimpleNamespace, which holds none"):
        offtensor.wrap(types.SimpleNamespace(scheduler="ddim"))
    no_lists = types.SimpleNamespace(vae=nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"no component of this SimpleNamespace has modules to offload "
                                         r"\(components: \['vae'\]\)"):
        offtensor.wrap(no_lists, device="cpu")
    pipe = flux_pipeline()
    offtensor.wrap(pipe, device="cpu")
    with pytest.raises(RuntimeError, match=r"this FluxPipeline is already wrapped; call offtensor.unwrap"):
        offtensor.wrap(pipe, device="cpu")
    with pytest.raises(ValueError, match=r"offtensor.unwrap: this SimpleNamespace is not wrapped"):
        offtensor.unwrap(no_lists)
