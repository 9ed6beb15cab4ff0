"""An interrupt anywhere in offtensor's code leaves no process state changed.

Ctrl-C raises `KeyboardInterrupt` between two bytecodes of whatever Python code runs. When it
landed inside the `torch.no_grad()` that a scope load used (after `__enter__` had turned grad
mode off, before the `with` body began), `__exit__` never ran and grad mode stayed off for the
rest of the process: every later training step failed (issue item 7, 2 in 780 interrupts).

The fuzzer below raises `KeyboardInterrupt` from a `sys.settrace` tracer at the N-th event
('call', 'line' or 'return') of a training step that occurs in offtensor's code, or in torch's
grad-mode context managers when offtensor called them. That is finer than real signals, which
CPython delivers only at function entries, loop back-edges and after calls. After each
interrupt, grad mode, inference mode, `__torch_function__` dispatch, the intra-op thread count
and offtensor's thread-local flags must be as before, and a full AdamW step of the same model
must match an unwrapped copy of it exactly (rtol=atol=0 on the CPU) and leave every scope
offloaded.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import sys
from collections.abc import Callable
from types import FrameType

import pytest
import tiers
import torch
import torch.nn.functional as F
from conftest import (
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    device_layout_bytes,
    mlp_of_blocks,
    split_policy,
    tiny_qwen3_moe,
)

import offtensor
from offtensor.dispatch import slot as _slot
from offtensor.dispatch.function_apply import recorded_functions

OFFTENSOR_DIR = os.path.dirname(os.path.abspath(offtensor.__file__)) + os.sep
# torch's grad-mode context managers: fuzzed where offtensor calls them (not where torch's
# checkpoint or optimizer code does, which offtensor cannot change).
TORCH_CM_FILES = tuple(
    os.path.join(os.path.dirname(torch.__file__), *parts)
    for parts in (("autograd", "grad_mode.py"), ("utils", "_contextlib.py"))
)
# Interrupt points tried per variant. The full tier (OFFTENSOR_TESTS=full, CI) spreads TRIALS
# points evenly over the step's events (every event would take minutes on a 2-core machine); the
# quick tier draws QUICK_TRIALS of all the events at random, a different draw for each sample
# seed (tiers.py). OFFTENSOR_INTERRUPT_TRIALS=150 spreads that many, in either tier (a deeper
# sweep).
TRIALS = int(os.environ.get("OFFTENSOR_INTERRUPT_TRIALS", "12"))
QUICK_TRIALS = 2


def _in_scope(frame: FrameType) -> bool:
    path = frame.f_code.co_filename
    if path.startswith(OFFTENSOR_DIR):
        return True
    if path in TORCH_CM_FILES:
        f = frame.f_back
        while f is not None and f.f_code.co_filename in TORCH_CM_FILES:
            f = f.f_back
        return f is not None and f.f_code.co_filename.startswith(OFFTENSOR_DIR)
    return False


class Interrupter:
    """Counts the step's events in offtensor's frames; raises KeyboardInterrupt at the `at`-th."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.events = 0
        self.fired = False

    def _event(self) -> None:
        self.events += 1
        if self.events == self.at and not self.fired:
            self.fired = True
            raise KeyboardInterrupt(f"fuzzer: event {self.at}")

    def _local(self, frame: FrameType, event: str, arg: object) -> Callable | None:
        if event in ("line", "return") and not self.fired:
            self._event()
        return self._local

    def _global(self, frame: FrameType, event: str, arg: object) -> Callable | None:
        if self.fired or not _in_scope(frame):
            return None
        self._event()  # 'call'
        return self._local

    def run(self, fn: Callable[[], None]) -> bool:
        """Run fn under the tracer; True when it was interrupted."""
        sys.settrace(self._global)
        try:
            fn()
        except KeyboardInterrupt:
            if not self.fired:
                raise
        finally:
            sys.settrace(None)
        # torch.utils.checkpoint (non-reentrant) runs the checkpointed function between two
        # steps of a generator that holds its saved-tensor hooks pushed; an exception out of the
        # function leaves that generator suspended until it is collected. On Python 3.12 it can
        # sit in a reference cycle with the traceback, so the next forward would save into the
        # dead checkpoint, with or without offtensor. Collect it, as the next statements of a
        # real program would in time.
        gc.collect()
        return self.fired


def _global_state() -> dict[str, object]:
    return {
        "grad enabled": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "torch function enabled": torch._C._is_torch_function_enabled(),
        "torch function all disabled": torch._C._is_torch_function_all_disabled(),
        "intra-op threads": torch.get_num_threads(),
        "worker_state.active": getattr(_slot.worker_state, "active", False),
        "recorded Functions": recorded_functions.depth,
    }


def _restore_global_state(expected: dict[str, object]) -> None:
    """After a failure, so that the next interrupt point is tested from a clean process."""
    torch._C._set_grad_enabled(True)
    torch.set_num_threads(expected["intra-op threads"])  # type: ignore[arg-type]
    _slot.worker_state.active = False
    recorded_functions.frames.clear()
    if not torch._C._is_torch_function_enabled():
        # An unentered guard's exit sets the state it saved at creation: ENABLED.
        torch._C.DisableTorchFunctionSubclass().__exit__(None, None, None)


VARIANTS = {
    "whole_blocks": dict(),
    "split_scopes": dict(split=True),
    "non_reentrant": dict(checkpoint="non_reentrant"),
    "reentrant": dict(checkpoint="reentrant"),
    "backward_and_step": dict(overlap=True),
    # max_grad_norm=: pieces held until backward returns, then clipped and handed over
    # (Note [clipping in the overlapped step]); an interrupt between must leave no worker waiting.
    "backward_and_step_clipped": dict(overlap=True, clip=True),
    # Frozen blocks stored in fp8: converting loads (staging buffer, chunk by chunk conversion).
    "frozen_fp8": dict(fp8=True),
    # Policy(vram_budget): blocks.0 kept resident (reloaded after each step), the rest streamed
    # into the budget's streaming room (split: the first scope, blocks.0.norm, and others spread
    # over the order by bytes are kept); a kept copy must never outlive a write to its masters.
    "vram_budget": dict(budget=True),
    "vram_budget_backward_and_step": dict(budget=True, overlap=True),
    "vram_budget_reentrant_split": dict(budget=True, split=True, checkpoint="reentrant"),
}


def _build(split: bool = False, checkpoint: str | None = None, fp8: bool = False, budget: bool = False):
    if fp8:  # matrices of 64 x 128: above offtensor.storage.compress.MIN_NUMEL, so compressed
        model = mlp_of_blocks(n_blocks=3, hidden=64, checkpoint=checkpoint)
        model.blocks.requires_grad_(False)
        offtensor.wrap(model, device="cpu", policy=offtensor.Policy(frozen_format="fp8"))
        assert any(s.packed is not None for scope in model._offtensor_engine.scopes for s in scope.slots)
        return model
    # Under a budget, 5 blocks: with 3, a budget of 4 (2 + prefetch to stream, one to keep)
    # holds them all, and every scope was kept, none streamed.
    model = mlp_of_blocks(n_blocks=5 if budget else 3, checkpoint=checkpoint)
    policy = split_policy(model) if split else offtensor.Policy()
    if budget:  # 2 + prefetch blocks to stream, one to keep
        policy = dataclasses.replace(policy, vram_budget=4 * device_layout_bytes(model.blocks[0]))
    offtensor.wrap(model, device="cpu", policy=policy)
    if budget:  # the first scope kept, some streamed
        kept = [s.kept for s in offtensor.summary(model).scopes]
        assert kept[0] and not all(kept)
    return model


def _check_step(model, x, y, overlap: bool) -> None:
    """One full AdamW step of the wrapped model and of a plain copy of its current values."""
    offtensor.wait_for_steps()
    for p in model.parameters():
        p.grad = None
    reference = copy.deepcopy(model)
    assert not any(isinstance(p, offtensor.OffloadedParameter) for p in reference.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    out = model(x)
    loss = F.mse_loss(out, y)
    if overlap:
        offtensor.backward_and_step(loss, opt).wait()
    else:
        loss.backward()
    ref_out = reference(x)
    F.mse_loss(ref_out, y).backward()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    assert_grads_match(model, reference, rtol=0, atol=0)
    if not overlap:
        opt.step()
    ref_opt.step()
    assert_params_match(model, reference, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


def _interrupt_points(variant: str, total: int, trials: int = TRIALS) -> list[int]:
    """Which of the step's ``total`` events to interrupt at (see TRIALS; `trials` in the full tier)."""
    if tiers.FULL or "OFFTENSOR_INTERRUPT_TRIALS" in os.environ:
        trials = int(os.environ.get("OFFTENSOR_INTERRUPT_TRIALS", trials))
        return list(range(1, total + 1, max(1, total // trials)))
    return sorted(tiers.rng(f"interrupts:{variant}").sample(range(1, total + 1), QUICK_TRIALS))


def _fuzz(variant: str) -> tuple[int, list[str]]:
    """Interrupt a training step at spread-out points; (points tried, failures)."""
    options = dict(VARIANTS[variant])
    overlap = options.pop("overlap", False)
    clip = {"max_grad_norm": 0.1} if options.pop("clip", False) else {}
    model = _build(**options)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        loss = F.mse_loss(model(x), y)
        if overlap:
            offtensor.backward_and_step(loss, opt, zero_grad=True, **clip)
        else:
            loss.backward()

    for _ in range(2):  # learn the orders: the fuzzed steps prefetch
        step()
    offtensor.wait_for_steps()
    expected = _global_state()
    counter = Interrupter(at=None)
    counter.run(step)
    offtensor.wait_for_steps()
    total = counter.events
    assert total > 100, f"only {total} traced events: is the tracer looking at offtensor's files?"
    points = _interrupt_points(variant, total)
    failures: list[str] = []
    for at in points:
        Interrupter(at).run(step)  # backward_and_step's event count varies: `at` may not come
        state = _global_state()
        try:
            changed = {k: (expected[k], v) for k, v in state.items() if v != expected[k]}
            assert not changed, f"state changed (before, after): {changed}"
            _check_step(model, x, y, overlap)
        except Exception as e:  # noqa: BLE001 - collected, reported together below
            failures.append(f"{variant}: interrupt at event {at}/{total}: {type(e).__name__}: {e}"[:600])
            _restore_global_state(expected)
            model = _build(**options)  # a fresh model, so later points are tested cleanly
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for _ in range(2):
                step()
            offtensor.wait_for_steps()
    return len(points), failures


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_interrupt_anywhere_in_a_training_step_leaves_no_state_changed(variant, one_thread):
    tried, failures = _fuzz(variant)
    assert not failures, f"{len(failures)} of {tried} interrupt points failed:\n" + "\n".join(failures[:10])


class _InPrepare(Interrupter):
    """Counts only the events inside BeforeStep.prepare (`active`, set by the test's wrapper)."""

    active = False

    def _event(self) -> None:
        if self.active:
            super()._event()


def test_interrupt_at_every_event_of_the_clipped_steps_total_norm_leaves_no_state_changed(one_thread, monkeypatch):
    """Every event of the total norm a clipped backward_and_step takes between backward and its
    first step (BeforeStep.prepare), interrupted in turn: torch's helpers decorated with no_grad
    turned grad mode off there, and an interrupt between their off and on left it off."""
    from offtensor.optim import clipping

    model = _build()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    current: list[_InPrepare] = []
    real = clipping.BeforeStep.prepare

    def prepare(self):
        current[0].active = True
        try:
            return real(self)
        finally:
            current[0].active = False

    monkeypatch.setattr(clipping.BeforeStep, "prepare", prepare)

    def step() -> None:
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True, max_grad_norm=0.1)

    def run(at: int | None) -> _InPrepare:
        current[:] = [_InPrepare(at)]
        current[0].run(step)
        offtensor.wait_for_steps()
        return current[0]

    for _ in range(2):
        run(None)
    expected = _global_state()
    total = run(None).events
    assert total > 20, total
    # Every event in the full tier; the quick one every 8th from a drawn offset (the window the
    # decorated helpers left open was 9 events wide).
    points = range(1, total + 1) if tiers.FULL else range(tiers.rng("total norm").randrange(8) + 1, total + 1, 8)
    for at in points:
        assert run(at).fired, at
        state = _global_state()
        assert state == expected, f"interrupt at event {at} of {total} in the total norm: {state}"
    _check_step(model, x, y, overlap=True)


def _fuzz_inference(variant: str, build: Callable[[], torch.nn.Module], check: Callable[[torch.nn.Module], None],
                    *, every_event: bool = False) -> None:
    """Interrupt a no_grad call of `build()`'s model (after three that learn its order) at
    spread-out points, or at every event in the full tier (`every_event`): no setting is left
    changed, the next calls equal a plain copy's and pass `check`, and a training step after
    them is exact."""
    model = build()
    x, y = torch.randn(4, 8), torch.randn(4, 4)

    def call() -> None:
        with torch.no_grad():
            model(x)

    for _ in range(3):
        call()
    expected = _global_state()
    counter = Interrupter(at=None)
    counter.run(call)
    total = counter.events
    assert total > 50, total
    points = list(range(1, total + 1)) if every_event and tiers.FULL else _interrupt_points(variant, total)
    failures: list[str] = []
    for at in points:
        Interrupter(at).run(call)
        try:
            state = _global_state()
            changed = {k: (expected[k], v) for k, v in state.items() if v != expected[k]}
            assert not changed, f"state changed (before, after): {changed}"
            reference = copy.deepcopy(model)
            with torch.no_grad():
                for _ in range(2):
                    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
            check(model)
            _check_step(model, x, y, overlap=False)
            call()  # (the step released what the calls carried: carry again)
        except Exception as e:  # noqa: BLE001 - collected, reported together below
            failures.append(f"interrupt at event {at}/{total}: {type(e).__name__}: {e}"[:600])
            _restore_global_state(expected)
            model = build()
            for _ in range(3):
                call()
    assert not failures, f"{len(failures)} of {len(points)} interrupt points failed:\n" + "\n".join(failures[:10])


def test_interrupt_anywhere_in_an_inference_call_that_carries_leaves_no_state_changed(one_thread):
    """Inference calls under a VRAM budget, whose ends load the next call's first scopes and carry
    them (Note [carried into the next forward] in budget/vram.py), interrupted at spread-out
    points: nothing but kept and carried scopes holds device memory after the next calls."""
    def build() -> torch.nn.Module:
        model = _build(budget=True).eval()
        with torch.no_grad():
            for _ in range(3):  # learn the order: the calls' ends carry
                model(torch.randn(4, 8))
        assert any(s.carried for s in offtensor.summary(model).scopes), "nothing carried between calls"
        return model

    _fuzz_inference("inference_carry", build, assert_all_scopes_offloaded)


def test_interrupt_anywhere_in_an_exposed_inference_pass_leaves_no_state_changed(one_thread):
    """Inference forwards of a model whose scopes are all kept, each an exposed pass (Note
    [exposed passes] in engine/model_hooks.py), interrupted anywhere (every event in the full
    tier): the next forwards leave no copy in the modules' attributes."""
    def build() -> torch.nn.Module:
        model = mlp_of_blocks(n_blocks=3)
        offtensor.wrap(model, device="cpu", policy=offtensor.Policy(vram_budget=1 << 30))
        assert all(s.kept for s in offtensor.summary(model).scopes)
        return model

    def nothing_exposed(model: torch.nn.Module) -> None:
        exposed = [(name, key) for name, m in model.named_modules() for key in m._parameters if key in m.__dict__]
        assert not exposed, f"copies left in the modules' attributes: {exposed}"

    _fuzz_inference("exposed_pass", build, nothing_exposed, every_event=True)


def test_interrupt_anywhere_in_a_step_and_the_forward_that_reloads_leaves_no_state_changed(one_thread):
    """A training loop on a model whose scopes are all kept: an optimizer step releases them, and
    the next forward with grad reloads them in an exposed pass (Note [a pass that reloads what a
    step wrote] in engine/model_hooks.py). Interrupted anywhere in the step, that forward or its
    backward: no setting is left changed, the next steps are exact (an interrupt in the optimizer's
    step once left a kept scope RESIDENT without memory, released halfway), and after them no copy
    stays in the modules' attributes."""
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = mlp_of_blocks(n_blocks=3)
        offtensor.wrap(model, device="cpu", policy=offtensor.Policy(vram_budget=1 << 30))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.01)
        for _ in range(3):  # the orders learned, and a step's gradients there
            call(model, opt)
        return model, opt

    x, y = torch.randn(4, 8), torch.randn(4, 4)

    def call(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.step()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()

    model, opt = build()
    expected = _global_state()
    counter = Interrupter(at=None)
    counter.run(lambda: call(model, opt))
    total = counter.events
    assert total > 50, total
    points = _interrupt_points("reload_pass", total, trials=150)  # a step of small calls: about 13 s
    failures: list[str] = []
    for at in points:
        Interrupter(at).run(lambda: call(model, opt))
        try:
            changed = {k: (expected[k], v) for k, v in _global_state().items() if v != expected[k]}
            assert not changed, f"state changed (before, after): {changed}"
            _check_step(model, x, y, overlap=False)  # its forward drops an interrupted pass's copies
            exposed = [(name, key) for name, m in model.named_modules() for key in m._parameters
                       if key in m.__dict__]
            assert not exposed, f"copies left in the modules' attributes: {exposed}"
            call(model, opt)  # a reload pass again, after the check's step
        except Exception as e:  # noqa: BLE001 - collected, reported together below
            failures.append(f"interrupt at event {at}/{total}: {type(e).__name__}: {e}"[:600])
            _restore_global_state(expected)
            model, opt = build()
    assert not failures, f"{len(failures)} of {len(points)} interrupt points failed:\n" + "\n".join(failures[:10])


def _tiny_routed_moe() -> torch.nn.Module:
    """A 2-layer Qwen3-MoE (16 experts, top 2, grouped_mm) with its experts routed, on the CPU."""
    model = tiny_qwen3_moe()
    offtensor.wrap(model, device="cpu")
    assert any(s.experts is not None for scope in model._offtensor_engine.scopes for s in scope.slots)
    return model.train()


class _InFunctions(Interrupter):
    """An Interrupter that counts only the events of offtensor's functions named `names`."""

    def __init__(self, at: int | None, names: frozenset[str]) -> None:
        super().__init__(at)
        self.names = names

    def _global(self, frame: FrameType, event: str, arg: object) -> Callable | None:
        if self.fired or frame.f_code.co_name not in self.names or not _in_scope(frame):
            return None
        self._event()  # 'call'
        return self._local


# The routed experts' bookkeeping (scopes/experts.py) and what calls it at a load and a release.
_ROUTED_FUNCTIONS = frozenset({"chosen", "done", "start", "fill", "_copy", "forget", "all_there",
                               "_forget_routed", "_routed_loaded", "release"})


def test_interrupt_anywhere_in_routed_experts_bookkeeping_leaves_no_state_changed(one_thread):
    """A training step of a model whose experts are routed (Note [routed experts] in
    scopes/experts.py), interrupted at events of the routed experts' bookkeeping (every one in
    the full tier): no setting is left changed and the next step equals a plain copy's.
    Regressions: the hook that copies the router's choice turned grad mode off before its `try`,
    so an interrupt there left it off for the process; and an interrupt in `forget` (a release)
    left `whole` set with no expert on the device, so later ops read rows never copied."""
    if os.environ.get("OFFTENSOR_LAZY_STREAMS") == "1":
        # The lagging side streams (tests/lazy_streams.py) keep no state an interrupt can leave
        # half done for the next entry point to find (Streams.restore is theirs a no-op): work
        # an interrupt left queued runs at arbitrary later waits.
        pytest.skip("an interrupt's side-stream state is not modelled by the lazy streams")
    model = _tiny_routed_moe()
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        model(ids, labels=ids).loss.backward()

    for _ in range(2):  # learn the orders: the interrupted steps copy the router's choice at once
        step()
    model.zero_grad()
    expected = _global_state()
    counter = _InFunctions(None, _ROUTED_FUNCTIONS)
    counter.run(step)
    model.zero_grad()
    assert counter.events > 50, counter.events
    points = (list(range(1, counter.events + 1)) if tiers.FULL
              else sorted(tiers.rng("interrupts:routed").sample(range(1, counter.events + 1), 12)))
    failures: list[str] = []
    for at in points:
        _InFunctions(at, _ROUTED_FUNCTIONS).run(step)
        try:
            state = _global_state()
            changed = {k: (expected[k], v) for k, v in state.items() if v != expected[k]}
            assert not changed, f"state changed (before, after): {changed}"
            model.zero_grad()
            reference = copy.deepcopy(model)
            loss, ref_loss = model(ids, labels=ids).loss, reference(ids, labels=ids).loss
            loss.backward()
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
            assert_grads_match(model, reference, rtol=0, atol=0)
            model.zero_grad()
        except Exception as e:  # noqa: BLE001 - collected, reported together below
            failures.append(f"interrupt at event {at}/{counter.events}: {type(e).__name__}: {e}"[:600])
            _restore_global_state(expected)
            model = _tiny_routed_moe()
            for _ in range(2):
                step()
            model.zero_grad()
    assert not failures, f"{len(failures)} of {len(points)} interrupt points failed:\n" + "\n".join(failures[:10])


def _lines_of_backward_and_steps_cleanup() -> list[int]:
    """The lines of backward_and_step from its `finally:` to its first `stepper.close()`: an
    interrupt on any of them used to skip the close."""
    import inspect

    from offtensor.optim import overlap as _overlap

    source, first = inspect.getsourcelines(_overlap.backward_and_step)
    start = next(i for i, line in enumerate(source) if line.strip() == "finally:")
    end = next(i for i, line in enumerate(source) if "stepper.close()" in line)
    return [first + i for i in range(start, end + 1)]


def test_interrupt_in_backward_and_steps_cleanup_leaves_no_worker_waiting(one_thread):
    """Regression: a KeyboardInterrupt on the `try:` line of backward_and_step's cleanup (found
    by the fuzzer on torch 2.6, whose event count put a point there) skipped `stepper.close()`:
    the optimizer worker waited for pieces forever, and so did the next `wait_for_steps()` or
    `backward_and_step`, and the engine kept handing gradients to that worker. Now the next wait
    closes an abandoned call, and the end of backward forgets the worker. Each line of the
    cleanup that the tracer sees is tried."""
    import threading

    from offtensor.optim import overlap as _overlap

    model = _build()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True)
    offtensor.wait_for_steps()
    tried = []
    for target in _lines_of_backward_and_steps_cleanup():
        fired = []

        def local(frame, event, arg, target=target, fired=fired):
            if event == "line" and frame.f_lineno == target and not fired:
                fired.append(target)
                raise KeyboardInterrupt("test: in backward_and_step's cleanup")
            return local

        def tracer(frame, event, arg, local=local):
            return local if frame.f_code is _overlap.backward_and_step.__code__ else None

        loss = F.mse_loss(model(x), y)
        sys.settrace(tracer)
        try:
            offtensor.backward_and_step(loss, opt, zero_grad=True)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        if not fired:
            continue  # no line event there (`finally:`, comments)
        tried.append(target)
        waiter = threading.Thread(target=offtensor.wait_for_steps, daemon=True)
        waiter.start()
        waiter.join(timeout=30)
        assert not waiter.is_alive(), f"line {target}: wait_for_steps() waits forever for the worker"
        assert model._offtensor_engine.grads.stepper is None, f"line {target}: the engine keeps the worker"
        # A plain backward after it steps nothing: no worker takes its gradients.
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        F.mse_loss(model(x), y).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0, msg=f"line {target}: {n}")
        _check_step(model, x, y, overlap=True)
    assert tried, "no line of the cleanup was interrupted"


def test_no_with_block_in_offtensor_turns_subclass_dispatch_off():
    # Note [interrupts] (dispatch/masters.py): a `with DisableTorchFunctionSubclass():` whose
    # exit an interrupt skips (at the end of its body, or at a `return` in it, where `with` calls
    # `__exit__`) leaves `__torch_function__` off for the whole process. The training-step fuzzer
    # found one in versions_of; this finds any in the package's source.
    import ast
    import pathlib

    found = []
    for path in pathlib.Path(OFFTENSOR_DIR).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if "DisableTorchFunction" in ast.unparse(item.context_expr):
                        found.append(f"{path.relative_to(OFFTENSOR_DIR)}:{node.lineno}")
    assert not found, f"use without_subclass_dispatch (turned off and on in C) instead: {found}"


def test_an_interrupt_anywhere_in_reading_versions_leaves_subclass_dispatch_on():
    from offtensor.scopes.write_tracking import versions_of

    model = mlp_of_blocks()
    offtensor.wrap(model, device="cpu")
    params = list(model.blocks.parameters())
    counter = Interrupter(at=None)
    counter.run(lambda: versions_of(params))
    assert counter.events >= 2
    for at in range(1, counter.events + 1):
        assert Interrupter(at).run(lambda: versions_of(params)), at
        enabled = torch._C._is_torch_function_enabled()
        if not enabled:  # for the tests after this one
            torch._C.DisableTorchFunctionSubclass().__exit__(None, None, None)
        assert enabled, f"left off by an interrupt at event {at}"


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_an_interrupt_anywhere_in_a_recorded_function_leaves_no_function_counted():
    # recorded_functions (dispatch/function_apply.py) counts the custom Functions whose forward
    # runs; an interrupt at the first line of `_function_apply`'s `finally` skipped the count's
    # undo, and every later scope call outside grad mode counted as a training call (found by a
    # deep sweep of the training-step fuzzer, variant vram_budget_reentrant_split).
    model = mlp_of_blocks()
    offtensor.wrap(model, device="cpu")  # installs offtensor's Function.apply
    x = torch.randn(3, requires_grad=True)
    counter = Interrupter(at=None)
    counter.run(lambda: _Double.apply(x))
    assert counter.events >= 3
    for at in range(1, counter.events + 1):
        assert Interrupter(at).run(lambda: _Double.apply(x)), at
        assert recorded_functions.depth == 0, f"a Function still counted after an interrupt at event {at}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_optimizer_step_after_an_interrupt_left_the_copy_stream_current_runs_on_compute():
    """A KeyboardInterrupt at a `with streams.on(...)` block's exit (Python traces the `with`
    line again before `__exit__`, outside the block's handler) leaves the copy stream current.
    The next eager optimizer step is an entry point: its device ops (the parameters left on the
    GPU) run on the stream that was current before, not unordered on offtensor's copy stream."""
    model = mlp_of_blocks(n_blocks=2)
    offtensor.wrap(model, lambda name, m: name in ("blocks.0", "blocks.1"), device="cuda")
    model.to("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    compute = torch.cuda.current_stream()
    streams = model._offtensor_engine.streams
    streams.on(streams.h2d()).__enter__()  # what such an interrupt leaves
    assert torch.cuda.current_stream() != compute
    opt.step()
    assert torch.cuda.current_stream() == compute
