"""Hugging Face Trainer with offtensor's overlapped optimizer step: `OverlapTrainer`.

On the micro-batch that steps, `offtensor.backward_and_step` runs backward, clips as the Trainer
would (`max_grad_norm=args.max_grad_norm` over `model.parameters()`, in that order, so the total
norm has the same bits), unscales first and skips an inf step when accelerate holds a
GradScaler (fp16), and steps the optimizer behind per-parameter fences while the next forward
begins. The loop's own clip then returns that norm, its `optimizer.step()` only updates the
scaler, and its `model.zero_grad()` leaves the optimizer's parameters alone
(`backward_and_step(zero_grad=True)` sets their grads to None as each is stepped; reading them
would wait for every step). Weights, optimizer state and logged grad norms equal the plain
Trainer's bit for bit on the CPU (tests/models/test_hf_tooling.py).

Single-process only (not DeepSpeed, FSDP, DDP or LOMO: their backward is not loss.backward()).

    python examples/trainer_overlap.py            # a tiny Llama on the CPU, a few steps
"""

from __future__ import annotations

import math
from typing import Any

import torch
from accelerate.utils import DistributedType
from torch import nn
from transformers import Trainer

import offtensor


class OverlapTrainer(Trainer):
    """A Trainer whose optimizer step is `offtensor.backward_and_step`, bit-identical to Trainer's."""

    _report: offtensor.OverlapReport | None = None  # of the step the loop has not finished yet
    _model: nn.Module | None = None  # the model the loop clips and zeroes (training_step's)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        plain_backward = self.accelerator.backward

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            if not self.accelerator.sync_gradients:
                return plain_backward(loss, **kwargs)  # a micro-batch that accumulates
            self._backward_and_step(loss, **kwargs)
            return None

        self.accelerator.backward = backward  # type: ignore[method-assign]

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self._model = model
        return super().training_step(model, inputs, num_items_in_batch)

    def _backward_and_step(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerator.backward's scaling of the loss, then backward_and_step with Trainer's clip."""
        if self.accelerator.distributed_type is not DistributedType.NO or getattr(self.accelerator,
                                                                                 "has_lomo_optimizer", False):
            raise RuntimeError(
                f"OverlapTrainer: {self.accelerator.distributed_type} training has a backward of its own, "
                "which backward_and_step cannot take the place of; use transformers.Trainer")
        assert self._model is not None
        accelerated = self.optimizer
        optimizer = getattr(accelerated, "optimizer", accelerated)  # the torch optimizer itself
        self._install(accelerated, self._model, optimizer)
        loss = loss / self.accelerator.gradient_accumulation_steps
        scaler = self.accelerator.scaler
        max_norm = self.args.max_grad_norm
        self._report = offtensor.backward_and_step(
            loss if scaler is None else scaler.scale(loss), optimizer, zero_grad=True, scaler=scaler,
            # Trainer clips with args.max_grad_norm, else measures the norm with max_norm=inf
            max_grad_norm=max_norm if max_norm is not None and max_norm > 0 else math.inf,
            clip_parameters=self._model.parameters(), **kwargs)

    def _install(self, accelerated: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The loop's `optimizer.step()` and `model.zero_grad()` after a backward_and_step (once)."""
        if "step" not in vars(accelerated):
            plain_step = accelerated.step

            def step(*args: Any, **kwargs: Any) -> Any:
                report, self._report = self._report, None
                if report is None:
                    return plain_step(*args, **kwargs)
                if accelerated.scaler is not None:  # what AcceleratedOptimizer.step does after scaler.step
                    accelerated.scaler.update()
                    accelerated._is_overflow = report.step_skipped
                return None

            accelerated.step = step
        if "zero_grad" not in vars(model):
            stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}

            def zero_grad(set_to_none: bool = True) -> None:
                for p in model.parameters():
                    if id(p) not in stepped and p.grad is not None:
                        if set_to_none:
                            p.grad = None
                        else:
                            p.grad.zero_()

            model.zero_grad = zero_grad  # type: ignore[method-assign]

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        report = self._report
        return super()._clip_grad_norm(model) if report is None else report.grad_norm

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None and self._report is not None:
            grad_norm = self._report.grad_norm
        return super()._get_grad_norm(model, grad_norm=grad_norm)


def main() -> None:
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    model = LlamaForCausalLM(config)
    offtensor.wrap(model, device="cpu")  # on a GPU: device="cuda", then model.to("cuda")
    ids = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=4, max_steps=8,
                                 gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-3,
                                 logging_steps=2, report_to=[], save_strategy="no")
        OverlapTrainer(model=model, args=args, train_dataset=data).train()


if __name__ == "__main__":
    main()
