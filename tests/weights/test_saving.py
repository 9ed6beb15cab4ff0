"""Saving and loading a wrapped model with the usual tools gives the unwrapped model's weights.

A scope's masters live in one host allocation; each must still look like a tensor of its own
to serializers (Note [one storage per master]): safetensors refuses tensors that share a
storage without covering it, and transformers' ``save_pretrained`` takes tensors sharing a
storage for tied weights.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    BlockStack,
    MixedDtypeBlock,
    devices,
    mlp_of_blocks,
    offload,
    offloaded_parameters,
    reference_then_offload,
    small_llama,
    tolerances,
)

import offtensor

st = pytest.importorskip("safetensors.torch")


def plain_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def assert_same_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k].dtype == v.dtype, k
        torch.testing.assert_close(got[k].cpu(), v, rtol=0, atol=0, msg=k)


def models() -> list:
    return [
        pytest.param(lambda: mlp_of_blocks(), id="fp32"),
        pytest.param(lambda: BlockStack([MixedDtypeBlock(), MixedDtypeBlock()], 8, 16, 4), id="mixed_dtypes"),
    ]


def test_each_master_has_its_own_storage_inside_the_scopes_host_buffer():
    model = offload(BlockStack([MixedDtypeBlock(), MixedDtypeBlock()], 8, 16, 4), "cpu")

    for name, p in offloaded_parameters(model):
        storage = p.untyped_storage()
        scope = p._ot.scope
        assert storage.nbytes() == p.numel() * p.element_size(), name
        # The bulk host-to-device copy reads host_flat: it must be the masters' own memory.
        assert storage.data_ptr() == scope.masters.flat.data_ptr() + p._ot.offset, name
        assert p.storage_offset() == 0, name


@pytest.mark.parametrize("make", models())
@pytest.mark.parametrize("device", devices)
def test_safetensors_save_model_and_load_model_round_trip(device, make, tmp_path):
    model = make()
    reference = reference_then_offload(model, device)
    expected = plain_state(reference)

    st.save_model(model, tmp_path / "model.safetensors")  # raised: storage shared, not covered

    assert_same_state(st.load_file(tmp_path / "model.safetensors"), expected)
    fresh = make()
    st.load_model(fresh, tmp_path / "model.safetensors")
    assert_same_state(plain_state(fresh), expected)
    # Into a wrapped model: the values go into the masters, which stay offloaded.
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in expected.items()}
    st.save_file(changed, tmp_path / "changed.safetensors")
    st.load_model(model, tmp_path / "changed.safetensors", device=device)
    reference.load_state_dict(changed)
    blocks = {n for n, _ in model.named_parameters() if n.startswith("blocks.")}
    assert {n for n, _ in offloaded_parameters(model)} == blocks
    assert_same_state(plain_state(model), plain_state(reference))
    x = torch.randn(3, 8, device=device)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))


@pytest.mark.parametrize("make", models())
@pytest.mark.parametrize("device", devices)
def test_safetensors_save_file_of_the_state_dict_round_trips(device, make, tmp_path):
    model = make()
    expected = plain_state(reference_then_offload(model, device))

    st.save_file(model.state_dict(), tmp_path / "state.safetensors")

    assert_same_state(st.load_file(tmp_path / "state.safetensors"), expected)


def whole_decoder(name: str, module: torch.nn.Module) -> bool:
    return name == "model"  # embeddings, all layers and the final norm in one scope


def embeddings_and_layers(name: str, module: torch.nn.Module) -> bool:
    return name == "model.embed_tokens" or name.startswith("model.layers.") and name.count(".") == 2


@pytest.mark.parametrize("predicate", [None, embeddings_and_layers, whole_decoder],
                         ids=["layers", "embeddings_and_layers", "whole_decoder"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_pretrained_and_from_pretrained_round_trip_hf_llama(tied, predicate, tmp_path):
    """transformers finds tied weights by shared storage; offloaded masters must not look tied
    to each other (it would save one and drop the others), and a really tied head and embedding
    must still be saved once."""
    transformers = pytest.importorskip("transformers")
    model = small_llama(checkpointing=False)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    expected = plain_state(model)
    offtensor.wrap(model, predicate, device="cpu")

    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)

    assert_same_state(plain_state(loaded), expected)
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # And back into the wrapped model, which stays wrapped.
    model.load_state_dict(loaded.state_dict())
    assert offtensor.is_wrapped(model) and dict(offloaded_parameters(model))
    assert_same_state(plain_state(model), expected)
