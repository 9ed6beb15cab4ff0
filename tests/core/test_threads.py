"""Two wrapped models trained at once in two threads, each with its own optimizer and
`backward_and_step`: each model trains as it does alone, and waits see both calls' steps.

Regressions: the latest `backward_and_step` was one module global, so of two calls that
started at once (both past the wait for earlier steps before either was recorded), the first
was forgotten: `offtensor.wait_for_steps()`, the optimizer's `state_dict()`, the wait before a
fork and the one at exit returned while its worker still stepped (a race, and at exit a
"terminate called without an active exception" abort). And each worker restored the intra-op
thread count it found on its own new thread, which a worker stepping beside it had lowered:
every thread started afterwards computed on one thread fewer. A failed deferred step of one
thread's call was raised by the other thread's next wait. And `no_offload()` exiting in one
thread released the scopes another thread's model was computing with.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_params_match, mlp_and_reference, random_batch

import offtensor
from offtensor.optim import overlap as _overlap
from offtensor.optim import worker as _worker

WORKER = "offtensor-optimizer"
TIMEOUT_S = 30


def _hold_worker(model: torch.nn.Module, holding: threading.Event, go: threading.Event) -> None:
    """The model's optimizer worker sets `holding` and waits for `go` before its first step."""
    def hold(_: torch.Tensor) -> None:
        if threading.current_thread().name == WORKER:
            holding.set()
            go.wait(TIMEOUT_S)

    for p in model.parameters():
        if isinstance(p, offtensor.OffloadedParameter):
            p.register_post_accumulate_grad_hook(hold)


def _threads_of_a_new_thread() -> int:
    found: list[int] = []
    thread = threading.Thread(target=lambda: found.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return found[0]


@pytest.mark.parametrize("released_first", ["b", "a"])
def test_two_models_stepped_at_once_in_two_threads_train_as_alone(monkeypatch, released_first):
    """Both calls get past their wait for earlier steps before either starts its worker, and b's
    worker starts while a's is stepping (b is the call recorded last, and its worker starts
    where a's has lowered its thread count). Released b first: a wait must still wait for a.
    Released a first: b's worker, the last to stop, leaves the thread count as it was."""
    (a, ref_a), (b, ref_b) = mlp_and_reference("cpu"), mlp_and_reference("cpu")
    batches = [random_batch("cpu"), random_batch("cpu")]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b)]
    holding = {"a": threading.Event(), "b": threading.Event()}
    go = {"a": threading.Event(), "b": threading.Event()}
    for model, name in zip((a, b), "ab", strict=True):
        _hold_worker(model, holding[name], go[name])
    both_waited = threading.Barrier(2)
    wait_for_steps = _overlap.wait_for_steps

    def racing_wait() -> None:
        wait_for_steps()
        both_waited.wait(TIMEOUT_S)
        if threading.current_thread().name == "b":
            holding["a"].wait(TIMEOUT_S)

    monkeypatch.setattr(_overlap, "wait_for_steps", racing_wait)
    # Each worker steps holding dynamo's compile lock (Note [compiling beside the optimizer
    # worker]): a's, held, would keep b's from stepping. Nothing compiles here.
    monkeypatch.setattr(_worker, "not_compiling", contextlib.nullcontext)
    errors: list[BaseException] = []
    threads_of_main = torch.get_num_threads()

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, batch) -> None:
        torch.set_num_threads(threads_of_main)  # Note [worker threads]: the reference's numerics
        try:
            offtensor.backward_and_step(F.mse_loss(model(batch[0]), batch[1]), opt, zero_grad=True)
        except BaseException as e:  # noqa: BLE001 - raised below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=train, args=(m, o, batch), name=name)
               for m, o, batch, name in zip((a, b), opts, batches, "ab", strict=True)]
    other = "a" if released_first == "b" else "b"
    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (offtensor.wait_for_steps(), waited.set()))
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
        assert not errors, errors
        assert not any(thread.is_alive() for thread in threads), "a backward_and_step hung"
        go[released_first].set()
        waiter.start()
        assert not waited.wait(0.3), f"wait_for_steps() returned while {other}'s steps were pending"
    finally:
        for event in go.values():
            event.set()
        if waiter.ident is not None:
            waiter.join(TIMEOUT_S)
        monkeypatch.undo()
    assert waited.is_set()
    try:
        assert _threads_of_a_new_thread() == threads_of_main, \
            "a thread started after the steps computes on fewer threads than the main thread"
    finally:
        torch.set_num_threads(threads_of_main)  # the default of new threads, back as it was

    for model, ref, batch in zip((a, b), (ref_a, ref_b), batches, strict=True):
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        F.mse_loss(ref(batch[0]), batch[1]).backward()
        ref_opt.step()
        assert_params_match(model, ref, rtol=0.0, atol=0.0)


def test_no_offload_exiting_in_one_thread_leaves_another_threads_forward_alone():
    """Regression: the exit of `no_offload(a)` released every wrapped model's scopes, b's too
    while b's backward was computing with them in another thread (freed device copies)."""
    (a, _), (b, ref_b) = mlp_and_reference("cpu"), mlp_and_reference("cpu")
    inside, go = threading.Event(), threading.Event()

    def pause(grad: torch.Tensor) -> None:
        inside.set()
        go.wait(TIMEOUT_S)

    def pause_in_backward(_module: torch.nn.Module, _args: tuple, out: torch.Tensor) -> None:
        out.register_hook(pause)

    # b pauses in the middle of blocks[1]'s backward: fc1's backward, to come, reads its weight.
    b.blocks[1].fc1.register_forward_hook(pause_in_backward)
    x, y = random_batch("cpu")
    outcome: list[object] = []

    def train_b() -> None:
        try:
            F.mse_loss(b(x), y).backward()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - raised below, on the test's thread
            outcome.append(e)

    thread = threading.Thread(target=train_b)
    thread.start()
    try:
        assert inside.wait(TIMEOUT_S)
        with offtensor.no_offload(a), torch.no_grad():
            a(x)
    finally:
        go.set()
        thread.join(TIMEOUT_S)
    assert outcome == [None], outcome
    F.mse_loss(ref_b(x), y).backward()
    assert_params_match(b, ref_b, rtol=0.0, atol=0.0)
    for name, p in b.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref_b.named_parameters())[name].grad, rtol=0.0, atol=0.0)


def test_a_deferred_step_that_fails_raises_in_the_thread_that_made_the_call():
    """Regression: the next wait for every call (here b's backward_and_step in the main thread)
    raised the failure of a's deferred step, made by another thread, which never saw it."""
    (a, _), (b, ref_b) = mlp_and_reference("cpu"), mlp_and_reference("cpu")
    opt_a, opt_b = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b))

    def fail(*_: object) -> None:
        if threading.current_thread().name == WORKER:
            raise ValueError("a's optimizer failed")

    opt_a.register_step_pre_hook(fail)
    returned, b_trained = threading.Event(), threading.Event()
    _hold_worker(a, threading.Event(), returned)  # a's steps fail once a's call has returned
    x, y = random_batch("cpu")
    seen_by_a: list[BaseException] = []

    def train_a() -> None:
        offtensor.backward_and_step(F.mse_loss(a(x), y), opt_a, zero_grad=True)
        returned.set()
        b_trained.wait(TIMEOUT_S)
        try:
            offtensor.wait_for_steps()
        except ValueError as e:
            seen_by_a.append(e)

    thread = threading.Thread(target=train_a)
    thread.start()
    try:
        assert returned.wait(TIMEOUT_S)
        offtensor.backward_and_step(F.mse_loss(b(x), y), opt_b, zero_grad=True)
        offtensor.wait_for_steps()
    finally:
        b_trained.set()
        thread.join(TIMEOUT_S)
    assert [str(e) for e in seen_by_a] == ["a's optimizer failed"]
    ref_opt = torch.optim.AdamW(ref_b.parameters(), lr=1e-2)
    F.mse_loss(ref_b(x), y).backward()
    ref_opt.step()
    assert_params_match(b, ref_b, rtol=0.0, atol=0.0)
