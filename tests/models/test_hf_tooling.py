"""A wrapped model driven by the usual tooling around a training loop: data loading with worker
processes, Hugging Face's Trainer, accelerate, PEFT and generate(), checked against the same
tooling driving the unwrapped model (all on the CPU, tiny random models, nothing downloaded).
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import (
    ResidualBlock,
    assert_all_scopes_offloaded,
    assert_params_match,
    host,
    mlp_and_reference,
    mlp_of_blocks,
    offload,
    random_batch,
    small_llama,
    step_both,
    train_step,
    unwrapped_reference,
)

import offtensor

pytestmark = [
    # transformers 5 renamed gradient_checkpointing_enable/disable; Trainer and user code call the old names
    pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True"),
]

EXACT = {"rtol": 0.0, "atol": 0.0}  # the CPU runs the same kernels on the same weights
VOCAB = 64  # small_llama's


class _Tokens(torch.utils.data.Dataset):
    """Causal-LM items (input_ids = labels) for small_llama, the same on every call."""

    def __init__(self, n: int = 8, length: int = 12) -> None:
        self.ids = torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.fixture
def accelerate():
    """accelerate, its process-wide state reset before and after the test (an Accelerator with
    another mixed precision refuses to start over a state that has one)."""
    accelerate = pytest.importorskip("accelerate")
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()
    yield accelerate
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()


def _llama_and_reference() -> tuple[torch.nn.Module, torch.nn.Module]:
    model = small_llama(checkpointing=False)
    reference = unwrapped_reference(model, "cpu")
    offtensor.wrap(model, device="cpu")
    return model, reference


class _ReadsAWeight(torch.utils.data.Dataset):
    """Each item is the sum of a wrapped parameter as the worker process sees it."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        self.weight = weight

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.weight.detach().sum()


def test_data_loader_forked_while_deferred_steps_run_sees_the_stepped_weights():
    # DataLoader workers fork at iter(); the optimizer worker thread of backward_and_step does
    # not exist in the child, so a child waiting for its pending steps would wait forever.
    model, _ = mlp_and_reference("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.register_step_pre_hook(lambda *_: time.sleep(0.3))  # still stepping at the fork
    x, y = random_batch("cpu")
    loss = torch.nn.functional.mse_loss(model(x), y)
    offtensor.backward_and_step(loss, optimizer, zero_grad=True)
    weight = model.blocks[0].fc1.weight
    loader = torch.utils.data.DataLoader(_ReadsAWeight(weight), batch_size=1, num_workers=1,
                                         multiprocessing_context="fork", timeout=20)

    seen = torch.cat(list(loader))

    offtensor.wait_for_steps()
    torch.testing.assert_close(seen, host(weight).sum().expand(2), rtol=0, atol=0)


def test_backward_and_step_refuses_an_accelerate_optimizer_wrapper_naming_the_fix(accelerate):
    # A view of the wrapper wrote its piece's groups into the wrapped optimizer: later steps
    # stepped only that piece. The message says what to pass instead.
    model, _ = mlp_and_reference("cpu")
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = random_batch("cpu")
    loss = torch.nn.functional.mse_loss(model(x), y)

    with pytest.raises(TypeError, match=r"AcceleratedOptimizer, a wrapper around AdamW.*optimizer\.optimizer"):
        offtensor.backward_and_step(loss, optimizer)

    assert len(optimizer.param_groups[0]["params"]) == len(list(model.parameters()))


def test_accelerate_accumulation_with_backward_and_step_on_the_wrapped_optimizer_matches_unwrapped(accelerate):
    model, reference = mlp_and_reference("cpu")
    batches = [random_batch("cpu") for _ in range(4)]

    def train(m: torch.nn.Module, overlap: bool) -> None:
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        m, optimizer = accelerator.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-2))
        for x, y in batches:
            with accelerator.accumulate(m):
                loss = torch.nn.functional.mse_loss(m(x), y)
                if overlap and accelerator.sync_gradients:
                    offtensor.backward_and_step(loss / 2, optimizer.optimizer, zero_grad=True)
                else:
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()

    train(reference, overlap=False)
    train(model, overlap=True)

    offtensor.wait_for_steps()
    assert_params_match(model, reference, rtol=0, atol=0)


def _cast_by_hand(reference: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What Policy(compute_dtype=torch.bfloat16) computes: each fp32 weight cast for the op."""
    params = {n: p.to(torch.bfloat16) for n, p in reference.named_parameters()}
    return torch.func.functional_call(reference, params, (x,))


@pytest.mark.parametrize("when", ["before training", "between steps"])
@pytest.mark.parametrize("sent", ["model", "state_dict"])
def test_sent_to_another_process_a_wrapped_model_keeps_training_on_its_stepped_masters(sent, when):
    # Spawned DataLoader workers get the dataset (here holding the model), and a
    # torch.multiprocessing queue its items (a state dict for a saving process), through
    # ForkingPickler, which moves each tensor's storage into shared memory. A master moved so
    # left the scope's host buffer, which converting loads copy from: every load after the next
    # step computed with the weights as they were when sent.
    from multiprocessing.reduction import ForkingPickler

    model = mlp_of_blocks()
    reference = unwrapped_reference(model, "cpu")
    offload(model, "cpu", lambda name, m: name in ("input", "head", "blocks.0", "blocks.1", "blocks.2"),
            policy=offtensor.Policy(compute_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    copied = None
    # Between steps the scopes have loaded from their masters' places already (HostMasters.take_back)
    for i, (x, y) in enumerate([random_batch("cpu") for _ in range(4)]):
        if i == (0 if when == "before training" else 2):
            copied = ForkingPickler.loads(ForkingPickler.dumps(model if sent == "model" else model.state_dict()))
        x = x.to(torch.bfloat16)
        out, ref_out = model(x), _cast_by_hand(reference, x)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        torch.nn.functional.mse_loss(out.float(), y).backward()
        torch.nn.functional.mse_loss(ref_out.float(), y).backward()
        step_both(model, reference, opt, ref_opt, {"rtol": 0, "atol": 0})

    assert_params_match(model, reference, rtol=0, atol=0)
    if sent == "model":  # the other process's copy is a plain model
        assert all(type(p) is torch.nn.Parameter for p in copied.parameters())
        assert not offtensor.is_wrapped(copied)


# --------------------------------------------------------------------------------------------
# transformers' Trainer, accelerate
# --------------------------------------------------------------------------------------------


def test_trainer_with_accumulation_checkpointing_clipping_and_a_schedule_trains_and_resumes_like_unwrapped(tmp_path):
    transformers = pytest.importorskip("transformers")

    def train(model: torch.nn.Module, out: str, resume: str | None = None) -> None:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out), use_cpu=True, per_device_train_batch_size=2, max_steps=4,
            gradient_accumulation_steps=2, gradient_checkpointing=True, max_grad_norm=0.5,
            learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=1, save_strategy="steps",
            save_steps=2, report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True)
        transformers.Trainer(model=model, args=args, train_dataset=_Tokens()).train(resume_from_checkpoint=resume)

    model, reference = _llama_and_reference()
    train(reference, "reference")
    train(model, "wrapped")
    assert_params_match(model, reference, **EXACT)
    assert offtensor.is_wrapped(model)

    resumed = small_llama(checkpointing=False)  # other random weights: the checkpoint's must win
    offtensor.wrap(resumed, device="cpu")
    train(resumed, "resumed", resume=str(tmp_path / "wrapped" / "checkpoint-2"))
    assert_params_match(resumed, reference, **EXACT)
    assert_all_scopes_offloaded(resumed)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerate_accumulation_clipping_and_saved_state_match_unwrapped(accelerate, mixed_precision, tmp_path):

    def train(model: torch.nn.Module, save: str | None = None, load: str | None = None) -> torch.Tensor:
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision=mixed_precision)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)
        loader = torch.utils.data.DataLoader(_Tokens(), batch_size=2)
        model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
        if load is not None:
            accelerator.load_state(load)
        losses = []
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.3)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
            losses.append(loss.detach().float())
        if save is not None:
            accelerator.save_state(save)
        assert accelerator.unwrap_model(model) is not None
        return torch.stack(losses)

    model, reference = _llama_and_reference()
    expected = train(reference, save=str(tmp_path / "reference"))
    torch.testing.assert_close(train(model, save=str(tmp_path / "wrapped")), expected, **EXACT)
    assert_params_match(model, reference, **EXACT)

    # load_state into models of other weights, then train on: the saved state must win
    again, ref_again = small_llama(checkpointing=False), small_llama(checkpointing=False)
    offtensor.wrap(again, device="cpu")
    expected = train(ref_again, load=str(tmp_path / "reference"))
    torch.testing.assert_close(train(again, load=str(tmp_path / "wrapped")), expected, **EXACT)
    assert_params_match(again, ref_again, **EXACT)


# --------------------------------------------------------------------------------------------
# PEFT
# --------------------------------------------------------------------------------------------


def _lora(peft, **kwargs):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           init_lora_weights=False, **kwargs)


def _adapter_steps(model: torch.nn.Module, adapters: list[str]) -> torch.Tensor:
    """A step per adapter in turn (set_adapter between steps), each followed by a forward with
    the adapters disabled; the logits of both."""
    ids = _Tokens().ids[:2]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    logits = []
    for name in adapters:
        model.set_adapter(name)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad(), model.disable_adapter():
            logits += [out.logits.detach(), model(input_ids=ids).logits]
    return torch.stack(logits)


@pytest.mark.parametrize("order", ["peft_after_wrap", "wrap_after_peft"])
def test_peft_adapters_switched_disabled_saved_and_reloaded_match_unwrapped(order, tmp_path):
    peft = pytest.importorskip("peft")
    base = small_llama(checkpointing=False)
    if order == "peft_after_wrap":  # the adapters are plain parameters inside the scopes
        reference = unwrapped_reference(base, "cpu")
        offtensor.wrap(base, device="cpu")
    models = []
    for b in (base, reference) if order == "peft_after_wrap" else (base,):
        torch.manual_seed(1)
        m = peft.get_peft_model(b, _lora(peft))
        torch.manual_seed(2)
        m.add_adapter("other", _lora(peft))
        models.append(m)
    if order == "wrap_after_peft":
        reference = unwrapped_reference(models[0], "cpu")
        offtensor.wrap(models[0], device="cpu")
        models.append(reference)
    model, reference = models
    for m in (model, reference):  # set_adapter trains the active adapter only: both stay trainable
        for name, p in m.named_parameters():
            p.requires_grad_("lora_" in name)

    expected = _adapter_steps(reference, ["default", "other", "default"])
    torch.testing.assert_close(_adapter_steps(model, ["default", "other", "default"]), expected, **EXACT)
    assert_params_match(model, reference, **EXACT)

    model.save_pretrained(tmp_path / "adapters")
    base = small_llama(checkpointing=False)
    ref_base = unwrapped_reference(base, "cpu")
    offtensor.wrap(base, device="cpu")
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapters")
    ref_reloaded = peft.PeftModel.from_pretrained(ref_base, tmp_path / "adapters")
    ids = _Tokens().ids[2:4]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, ref_reloaded(input_ids=ids).logits, **EXACT)
        merged, ref_merged = reloaded.merge_and_unload(), ref_reloaded.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=ids).logits, ref_merged(input_ids=ids).logits, **EXACT)
    assert offtensor.is_wrapped(merged)


def test_peft_modules_to_save_inside_a_wrapped_layer_trains_like_unwrapped(tmp_path):
    # PEFT deep-copies each module named in modules_to_save (here every layer's MLP, inside a
    # scope) into a trainable copy: a copy of part of a wrapped model is plain.
    peft = pytest.importorskip("peft")
    base = small_llama(checkpointing=False)
    reference_base = unwrapped_reference(base, "cpu")
    offtensor.wrap(base, device="cpu")
    torch.manual_seed(1)
    model = peft.get_peft_model(base, _lora(peft, modules_to_save=["mlp"]))
    torch.manual_seed(1)
    reference = peft.get_peft_model(reference_base, _lora(peft, modules_to_save=["mlp"]))
    copies = [p for n, p in model.named_parameters() if ".mlp.modules_to_save." in n]
    assert copies and all(type(p) is torch.nn.Parameter and p.requires_grad for p in copies)

    expected = _adapter_steps(reference, ["default"] * 3)
    torch.testing.assert_close(_adapter_steps(model, ["default"] * 3), expected, **EXACT)
    assert_params_match(model, reference, **EXACT)
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# generate() and checkpointing between training steps
# --------------------------------------------------------------------------------------------

_GENERATE = {
    "sample": {"do_sample": True, "top_k": 10, "temperature": 0.9},
    "beam_search": {"num_beams": 3, "num_return_sequences": 2},
    "samples_per_prompt": {"do_sample": True, "num_return_sequences": 3},
    "static_cache": {"cache_implementation": "static"},
    "no_cache": {"use_cache": False},
}


def test_generate_variants_between_training_steps_match_unwrapped():
    model, reference = _llama_and_reference()
    prompt = _Tokens().ids[:2, :5]
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)}

    def generate(m: torch.nn.Module, kwargs: dict) -> torch.Tensor:
        m.eval()
        torch.manual_seed(7)
        out = m.generate(prompt, max_new_tokens=5, min_new_tokens=5, pad_token_id=0, **kwargs)
        m.train()
        return out

    for _ in range(2):
        for name, kwargs in _GENERATE.items():
            torch.testing.assert_close(generate(model, kwargs), generate(reference, kwargs), **EXACT,
                                       msg=lambda m, name=name: f"{name}: {m}")
        for m in (model, reference):
            m(input_ids=prompt, labels=prompt).loss.backward()
            optimizers[id(m)].step()
            optimizers[id(m)].zero_grad()
        assert_params_match(model, reference, **EXACT)
    assert_all_scopes_offloaded(model)


def test_transformers_checkpointing_toggled_between_steps_trains_like_unwrapped():
    model, reference = _llama_and_reference()
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)}
    ids = _Tokens().ids[:2]
    for kwargs in [None, {"use_reentrant": True}, {"use_reentrant": False}, None, {"use_reentrant": True}]:
        losses = []
        for m in (model, reference):
            if kwargs is None:
                m.gradient_checkpointing_disable()
            else:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            for micro in range(2):  # accumulated, clipped
                loss = m(input_ids=ids[micro:micro + 1], labels=ids[micro:micro + 1]).loss
                (loss / 2).backward()
            losses.append(loss.detach())
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
            optimizers[id(m)].step()
            optimizers[id(m)].zero_grad()
        torch.testing.assert_close(losses[0], losses[1], **EXACT)
        assert_params_match(model, reference, **EXACT)


@pytest.mark.parametrize("selected", ["blocks", "leaf_linears"])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_sequential_over_a_wrapped_sequential_trains_like_unwrapped(selected, use_reentrant):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), *[ResidualBlock(16) for _ in range(6)], torch.nn.Linear(16, 4))
    reference = unwrapped_reference(model, "cpu")
    block_type = ResidualBlock if selected == "blocks" else torch.nn.Linear
    offtensor.wrap(model, lambda name, m: isinstance(m, block_type), device="cpu")
    optimizers = {id(m): torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)}
    for step in range(3):
        x, y = random_batch("cpu")
        x.requires_grad_(step == 1)
        for m in (model, reference):
            out = torch.utils.checkpoint.checkpoint_sequential(m, 3, x, use_reentrant=use_reentrant)
            torch.nn.functional.mse_loss(out, y).backward()
            optimizers[id(m)].step()
            optimizers[id(m)].zero_grad()
        assert_params_match(model, reference, **EXACT)
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# DataLoader workers holding the model
# --------------------------------------------------------------------------------------------


class _TeacherLogits(torch.utils.data.Dataset):
    """Items with the logits of the model, computed in the worker (distillation from a model the
    loop trains)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.ids = _Tokens().ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {"input_ids": self.ids[i], "teacher": self.model(input_ids=self.ids[i:i + 1]).logits[0]}


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "backward_and_step"])
def test_forked_data_loader_workers_running_the_wrapped_model_see_the_weights_at_each_epoch(overlap):
    model, reference = _llama_and_reference()

    def train(m: torch.nn.Module, overlap: bool) -> torch.Tensor:
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        seen = []
        for _ in range(2):  # the workers fork at each epoch's iter()
            loader = torch.utils.data.DataLoader(_TeacherLogits(m), batch_size=4, num_workers=2,
                                                 multiprocessing_context="fork", timeout=60)
            for batch in loader:
                seen.append(batch["teacher"])
                train_step(m(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss, optimizer,
                           overlap=overlap)
        offtensor.wait_for_steps()
        return torch.stack(seen)

    expected = train(reference, overlap=False)
    torch.testing.assert_close(train(model, overlap), expected, **EXACT)
    assert_params_match(model, reference, **EXACT)


def test_resize_token_embeddings_of_a_selected_embedding_raises_naming_it_and_changes_nothing():
    model = small_llama(checkpointing=False)
    reference = unwrapped_reference(model, "cpu")
    offtensor.wrap(model, lambda name, m: name == "model.embed_tokens", device="cpu")

    with pytest.raises(TypeError, match=r"'model\.embed_tokens\.weight'.*keep their shape.*offtensor\.unwrap"):
        model.resize_token_embeddings(VOCAB + 8)

    assert model.config.vocab_size == VOCAB and model.model.embed_tokens.weight.shape[0] == VOCAB
    ids = _Tokens().ids[:2]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, **EXACT)


def test_resize_token_embeddings_after_wrap_with_the_default_predicate_trains_like_unwrapped():
    # The embeddings and the head are not scopes: transformers replaces them as usual.
    model, reference = _llama_and_reference()
    for m in (model, reference):
        torch.manual_seed(3)
        m.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    ids = torch.randint(VOCAB, VOCAB + 8, (2, 6))
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)}
    for _ in range(2):
        for m in (model, reference):
            m(input_ids=ids, labels=ids).loss.backward()
            optimizers[id(m)].step()
            optimizers[id(m)].zero_grad()
    assert_params_match(model, reference, **EXACT)


def test_accelerate_set_module_tensor_to_device_on_a_wrapped_model_gives_a_plain_parameter():
    # It rebuilds the parameter as type(p)(value): that made an OffloadedParameter of no scope,
    # which isinstance checks and printing took for an offloaded one.
    pytest.importorskip("accelerate")
    from accelerate.utils import set_module_tensor_to_device

    model, _ = mlp_and_reference("cpu")
    value = torch.randn(32, 16)
    set_module_tensor_to_device(model, "blocks.0.fc1.weight", "cpu", value=value)

    weight = model.blocks[0].fc1.weight
    assert type(weight) is torch.nn.Parameter and weight.requires_grad
    torch.testing.assert_close(weight.detach(), value, **EXACT)


def test_trainer_bf16_full_eval_raises_naming_the_parameter_and_compute_dtype(tmp_path):
    # bf16_full_eval converts the model with model.to(torch.bfloat16) before evaluating.
    transformers = pytest.importorskip("transformers")
    model, _ = _llama_and_reference()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, bf16_full_eval=True,
                                          per_device_eval_batch_size=2, report_to=[], disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=_Tokens(4))

    with pytest.raises(TypeError, match=r"'model\.layers\.0\.[\w.]+' from torch\.float32 to torch\.bfloat16.*"
                                        r"Policy\(compute_dtype=torch\.bfloat16\).*bf16_full_eval"):
        trainer.evaluate()

    assert all(p.dtype == torch.float32 for p in model.parameters())


def _overlap_trainer_class() -> type:
    """examples/trainer_overlap.py's OverlapTrainer (examples/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "trainer_overlap.py"
    spec = importlib.util.spec_from_file_location("trainer_overlap", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.OverlapTrainer


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0], ids=["clipped", "norm_only"])
def test_overlap_trainer_trains_and_logs_like_trainer(max_grad_norm, tmp_path, monkeypatch):
    """examples/trainer_overlap.py: Trainer's clip (max_grad_norm=0.5 clips this model's
    gradients), accumulation over 2 micro-batches and a schedule, with every optimizer step
    taken by backward_and_step: weights, optimizer state and logged grad norms bit-identical."""
    transformers = pytest.importorskip("transformers")
    overlap_trainer = _overlap_trainer_class()
    calls = []
    plain = offtensor.backward_and_step
    monkeypatch.setattr(offtensor, "backward_and_step", lambda *a, **k: calls.append(k) or plain(*a, **k))

    def train(cls: type, model: torch.nn.Module, out: str) -> transformers.Trainer:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out), use_cpu=True, per_device_train_batch_size=2, max_steps=4,
            gradient_accumulation_steps=2, max_grad_norm=max_grad_norm, learning_rate=1e-2,
            lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1, save_strategy="no", report_to=[],
            seed=0, dataloader_num_workers=0, disable_tqdm=True)
        trainer = cls(model=model, args=args, train_dataset=_Tokens())
        trainer.train()
        return trainer

    model, reference = _llama_and_reference()
    expected = train(transformers.Trainer, reference, "reference")
    trainer = train(overlap_trainer, model, "overlap")
    assert len(calls) == 4 and all(k["max_grad_norm"] == (max_grad_norm or float("inf")) for k in calls)
    assert_params_match(model, reference, **EXACT)
    norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
    assert norms == [log["grad_norm"] for log in expected.state.log_history if "grad_norm" in log]
    assert len(norms) == 4 and (max_grad_norm == 0 or max(norms) > max_grad_norm)  # it did clip
    state, ref_state = trainer.optimizer.state_dict()["state"], expected.optimizer.state_dict()["state"]
    for k in ref_state:
        for name, value in ref_state[k].items():
            torch.testing.assert_close(state[k][name], value, **EXACT)
    assert_all_scopes_offloaded(model)
