"""--shape qwen3-30b-a3b | gpt-oss-20b: the mixture-of-experts benchmark runs end to end on the CPU
(tiny, 2 layers), every peer computes the resident model's outputs bit for bit, and a routed
decode token copies at most 1.10x the non-expert bytes plus the bytes of the experts its routers
picked, counted here from the routers, apart from the benchmark's own count."""

from __future__ import annotations

import json

import pytest
import torch

import offtensor

pytest.importorskip("transformers")
pytest.importorskip("peft")

import benchmarks as bench
from benchmarks import cli
from benchmarks.moe import MOE_PEER_NAMES, MOE_SHAPES, QUICK_MOE_SHAPES, build_moe, setup_moe_peer, with_cache

CPU = torch.device("cpu")


@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_quick_moe_run_is_exact_and_copies_the_active_bytes(shape, tmp_path, capsys, one_thread):
    out = tmp_path / "moe.json"
    assert bench.main(["--quick", "--device", "cpu", "--shape", shape, "--layers", "2", "--warmup", "1",
                       "--iters", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["scenario"], r["peer"]): r for r in result["results"]}
    assert {p for _, p in rows} == set(MOE_PEER_NAMES)
    for (scenario, peer), r in rows.items():
        assert r["status"] == "ok", (scenario, peer, r["note"])
        assert r["median_ms"] > 0 and r["tokens_per_s"] > 0
        assert r["exact"] is True, (scenario, peer, r["max_abs_diff"])  # bit for bit the resident model's
    for batch in (1, 8):
        routed, whole = rows[(f"decode-{batch}", "offtensor-routed")], rows[(f"decode-{batch}", "offtensor-whole")]
        assert routed["bytes_per_step"] <= 1.10 * routed["active_bytes"], routed
        assert whole["bytes_per_step"] > routed["bytes_per_step"]
        assert whole["x_active"] > 1.5  # the whole layers: every expert
    # Note [one host read per layer]: the router's choice, and gpt-oss's biases indexed by sorted ids
    reads = 2 * (3 if shape == "gpt-oss-20b" else 1)  # 2 layers
    for peer in ("offtensor-routed", "offtensor-routed-cache"):
        for batch in (1, 8):
            r = rows[(f"decode-{batch}", peer)]
            assert r["host_reads_per_step"] <= reads and r["host_calls_per_step"] > 0, r
    # Note [host work per step]: the routed scopes' other parameters are exposed in their calls,
    # and ops on routed ones after the router's choice take the short path (Note [calls of a
    # loaded scope] in engine/hooks.py): Python calls within 2x the resident model's (2.2-2.7x before)
    resident = rows[("decode-1", "resident")]["host_calls_per_step"]
    assert rows[("decode-1", "offtensor-routed")]["host_calls_per_step"] <= 2 * resident, rows
    kept, streamed = rows[("decode-1", "offtensor-routed-vram")], rows[("decode-1", "offtensor-routed")]
    assert kept["expert_hit_rate"] > 0 and kept["bytes_per_step"] < streamed["bytes_per_step"]
    assert result["model"]["shape"]["layers"] == 2
    printed = capsys.readouterr().out
    assert "| peer | decode-1 | decode-8 | prefill-1x2048 | lora-step-1x2048 |" in printed
    assert "experts=None" in result["setups"]["offtensor-whole"]
    assert "vram_budget=" in result["setups"]["offtensor-routed-vram"]


def _picked(model: torch.nn.Module) -> dict[str, set[int]]:
    """Forward pre-hooks on each experts module: the experts its router picked in the last call."""
    picked: dict[str, set[int]] = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            def hook(mod, args, kwargs, name=name):
                index = args[1] if len(args) > 1 else next(v for k, v in kwargs.items() if k.endswith("index")
                                                          or k == "router_indices")
                picked[name] = set(index.unique().tolist())
            module.register_forward_pre_hook(hook, with_kwargs=True)
    return picked


@pytest.mark.parametrize("shape", list(QUICK_MOE_SHAPES))
def test_a_routed_decode_token_copies_at_most_1_10x_the_active_bytes(shape):
    built = build_moe(QUICK_MOE_SHAPES[shape], CPU, 0)
    setup_moe_peer("offtensor-routed", built, CPU, None)
    picked = _picked(built.model)
    model = built.model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.randint(1, 512, (1, 8)), use_cache=True)
        before = offtensor.summary(model).bytes_to_device
        model(input_ids=out.logits[:, -1:].argmax(-1), **with_cache(model, out), use_cache=True)
        copied = offtensor.summary(model).bytes_to_device - before
    needed = whole = 0
    for i, layer in enumerate(built.layers):
        experts = layer.mlp.experts
        stacked = [p for p in experts.parameters(recurse=False) if p.dim() >= 2]
        frozen = sum(p.numel() * p.element_size() for p in layer.parameters() if not p.requires_grad)
        routed = sum(p.numel() * p.element_size() for p in stacked)
        one = sum(p[0].numel() * p.element_size() for p in stacked)
        needed += frozen - routed + one * len(picked[f"model.layers.{i}.mlp.experts"])
        whole += frozen
    assert copied <= 1.10 * needed, (copied, needed, whole)
    assert copied < whole / 2


@pytest.mark.parametrize("shape,total,active", [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("gpt-oss-20b", 20.9e9, 3.6e9)])
def test_the_shapes_have_the_published_parameter_counts(shape, total, active):
    """Built on the meta device: Qwen3-30B-A3B's 30.5B parameters (3.3B active), gpt-oss-20b's
    20.9B (3.6B active, the input embeddings not counted as its card counts them)."""
    s = MOE_SHAPES[shape]
    model = build_moe(s, CPU, 0).model
    base = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    experts = sum(p.numel() for n, p in base.items() if ".experts." in n)
    used = sum(p.numel() for p in base.values()) - experts + experts * s.top_k // s.experts
    if shape == "gpt-oss-20b":
        used -= model.get_input_embeddings().weight.numel()
    assert sum(p.numel() for p in base.values()) == pytest.approx(total, rel=0.01)
    assert used == pytest.approx(active, rel=0.02)


def test_moe_shapes_take_their_own_peers_and_layers():
    args = cli.parse_args(["--shape", "qwen3-30b-a3b", "--layers", "2"])
    assert tuple(args.peers) == MOE_PEER_NAMES and args.layers == 2
    assert args.scenarios == ["decode-1", "decode-8", "prefill-1x2048", "lora-step-1x2048"]
    with pytest.raises(SystemExit):
        cli.parse_args(["--shape", "gpt-oss-20b", "--peers", "offtensor-fp8"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--shape", "gpt-oss-20b", "--compile"])


def test_decode_floor_is_the_resident_step_plus_the_bytes_at_the_link_speed():
    from benchmarks.moe_run import MoeRow, decode_floor, format_moe_table

    resident = MoeRow("decode-1", "resident", "ok", median_ms=10.0, tokens_per_s=100.0)
    whole = MoeRow("decode-1", "offtensor-whole", "ok", median_ms=300.0, tokens_per_s=3.3, bytes_per_step=int(14e9))
    routed = MoeRow("decode-1", "offtensor-routed", "ok", median_ms=36.0, tokens_per_s=27.8, bytes_per_step=int(1e9))
    rows = [resident, whole, routed]
    floor, ratio = decode_floor(rows, routed, h2d=50e9)
    assert floor == pytest.approx(30.0) and ratio == pytest.approx(1.2)
    assert decode_floor(rows, resident, h2d=50e9) is None  # copies nothing: no floor of its own
    table = format_moe_table(rows, "head", h2d=50e9).splitlines()
    routed_line = next(line for line in table if line.startswith("| offtensor-routed |"))
    assert "| 30.0 | 1.20 | 8.3 |" in routed_line  # floor ms, x floor, 300 / 36 ms x whole
    resident.compute_busy_ms = 4.0  # profiled on CUDA: the kernels' busy time, not the host-bound step
    floor, ratio = decode_floor(rows, routed, h2d=50e9)
    assert floor == pytest.approx(24.0) and ratio == pytest.approx(1.5)


def test_host_profile_of_a_routed_decode_step(tmp_path, capsys, one_thread):
    """--host-profile on a MoE shape: the decode rows carry one step's cProfile (batch 1 and 8)."""
    out = tmp_path / "moe.json"
    assert bench.main(["--quick", "--device", "cpu", "--shape", "qwen3-30b-a3b", "--layers", "2", "--warmup", "1",
                       "--iters", "1", "--peers", "resident", "offtensor-routed", "--scenarios", "decode-1",
                       "--host-profile", "4", "--json", str(out)]) == 0
    rows = {(r["scenario"], r["peer"]): r for r in json.loads(out.read_text())["results"]}
    routed = rows[("decode-1", "offtensor-routed")]["host_profile"]
    assert len(routed["own"]) == 4 and routed["offtensor"], routed
    assert not rows[("decode-1", "resident")]["host_profile"]["offtensor"]
    assert "host profile: step" in capsys.readouterr().out
