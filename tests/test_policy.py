"""`offtensor.Policy` checks its options when made: sizes as people write them ("16GiB", "512MB",
1.5e9) become bytes, and a value of the wrong type (a bool, which is an int to Python) or out of
range is refused with an error naming the option and a value it takes."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from conftest import mlp_of_blocks

import offtensor

SIZE_FIELDS = ["max_scope_bytes", "vram_budget", "host_budget"]


@pytest.mark.parametrize("written, nbytes", [
    (123456, 123456),
    (np.int64(4096), 4096),
    (1.5e9, 1_500_000_000),
    (2048.7, 2048),  # a fraction of a byte is dropped
    ("16GiB", 16 * 2**30),
    ("16GB", 16 * 10**9),
    ("512MiB", 512 * 2**20),
    ("512 mib", 512 * 2**20),
    ("1.5GiB", 3 * 2**29),
    ("1.1GB", 1_100_000_000),  # exact, no float rounding
    ("2TB", 2 * 10**12),
    ("3TiB", 3 * 2**40),
    ("64KB", 64_000),
    ("64kib", 64 * 2**10),
    ("100B", 100),
    ("100", 100),
    ("1e9", 10**9),
    (" 8 GiB ", 8 * 2**30),
], ids=repr)
@pytest.mark.every_case
def test_a_size_is_bytes_whether_an_int_a_float_or_a_string_with_a_unit(written, nbytes):
    for name in SIZE_FIELDS:
        policy = offtensor.Policy(**{name: written})
        assert getattr(policy, name) == nbytes and type(getattr(policy, name)) is int, name


def test_vram_budget_auto_and_none_stay_as_given():
    assert offtensor.Policy(vram_budget="auto").vram_budget == "auto"
    assert all(getattr(offtensor.Policy(), name) is None for name in SIZE_FIELDS)


@pytest.mark.parametrize("bad, error", [
    (-1, ValueError),
    (0, ValueError),
    (-2.5e9, ValueError),
    (float("nan"), ValueError),
    (float("inf"), ValueError),
    ("-1GiB", ValueError),
    ("0.1B", ValueError),  # under a byte
    ("lots", ValueError),
    ("16 gigabytes", ValueError),
    ("16XB", ValueError),
    ("", ValueError),
    ("GiB", ValueError),
    (True, TypeError),
    (False, TypeError),
    ([2**30], TypeError),
    (torch.device("cpu"), TypeError),
], ids=repr)
@pytest.mark.every_case
def test_error_if_a_size_is_not_a_positive_number_of_bytes_names_the_option_and_an_example(bad, error):
    for name in SIZE_FIELDS:
        with pytest.raises(error, match=rf"offtensor\.Policy: {name} must be a positive number of bytes "
                           r"\(an int, a float such as 1\.5e9, or a string such as '16GiB', '16GB' or "
                           rf"'512MiB'\).*got {re.escape(repr(bad))}"):
            offtensor.Policy(**{name: bad})


def test_error_if_a_size_string_has_an_unknown_unit_lists_the_units():
    with pytest.raises(ValueError, match=r"vram_budget .*'auto' or None \(units B, KB, MB, GB, TB, KiB, MiB, "
                       r"GiB, TiB\); got '16XB'"):
        offtensor.Policy(vram_budget="16XB")


def test_max_scope_bytes_true_is_refused_not_taken_for_one_byte():
    """Regression: Policy(max_scope_bytes=True) was accepted as 1 byte and split every block into
    one scope per child (4 blocks into 12 scopes); host_budget=True was refused."""
    with pytest.raises(TypeError, match=r"max_scope_bytes must be .*got True \(bool\)"):
        offtensor.Policy(max_scope_bytes=True)


@pytest.mark.parametrize("bad, error", [(True, TypeError), (1.0, TypeError), ("2", TypeError), (-1, ValueError)],
                         ids=repr)
@pytest.mark.every_case
def test_error_if_prefetch_is_not_an_int_of_at_least_zero(bad, error):
    with pytest.raises(error, match=rf"offtensor\.Policy: prefetch must be an int >= 0, got {re.escape(repr(bad))}"):
        offtensor.Policy(prefetch=bad)


def test_error_if_keep_for_backward_or_pin_memory_is_not_a_bool():
    with pytest.raises(TypeError, match=r"keep_for_backward must be True or False, got 1"):
        offtensor.Policy(keep_for_backward=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pin_memory must be None, True, False or 'ring', got 1"):
        offtensor.Policy(pin_memory=1)  # type: ignore[arg-type]


def test_a_size_written_as_a_string_wraps_as_its_bytes_do():
    """The scopes max_scope_bytes="1KiB" splits are those of max_scope_bytes=1024, and the model
    computes as the plain one."""
    scopes = []
    for limit in ("1KiB", 1024):
        model = mlp_of_blocks(n_blocks=2)
        reference = mlp_of_blocks(n_blocks=2)
        reference.load_state_dict(model.state_dict())
        offtensor.wrap(model, device="cpu", policy=offtensor.Policy(max_scope_bytes=limit))
        scopes.append([s.name for s in offtensor.summary(model).scopes])
        x = torch.randn(3, 8)
        torch.testing.assert_close(model(x), reference(x))
    assert scopes[0] == scopes[1] and len(scopes[0]) > 2
