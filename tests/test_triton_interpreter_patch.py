"""tests/triton_interpreter_patch.py, which tests/conftest.py installs under TRITON_INTERPRET=1: nested @triton.jit
helpers compute what they did, the language is patched once per launch instead of once per helper call, and every
builtin is Triton's own again after a launch, also after one that failed."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
import triton_interpreter_patch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1"
                                or os.environ.get("PAGEDSERVE_TEST_PLAIN_INTERPRETER") == "1",
                                reason="only Triton's CPU interpreter is patched")


@triton.jit
def _inner(x):
    return x * 2 + 1


@triton.jit
def _outer(x, STEPS: tl.constexpr):
    for _ in range(STEPS):
        x = _inner(x)
    return tl.where(x > 100, x - 100, x)


@triton.jit
def _steps_kernel(x_ptr, out_ptr, N: tl.constexpr, STEPS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + tl.program_id(0) * N + offs)
    tl.store(out_ptr + tl.program_id(0) * N + offs, _outer(x, STEPS))


@triton.jit
def _standard_kernel(x_ptr, out_ptr, N: tl.constexpr, STEPS: tl.constexpr):
    # tl.sum and tl.cdiv are @jit functions of triton.language.standard, whose globals hold triton.language.core,
    # which this module's do not: the first call patches core, the later ones find it patched
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + tl.program_id(0) * N + offs)
    for _ in range(STEPS):
        x = x - tl.sum(x, 0) / tl.cdiv(N, 2)
    tl.store(out_ptr + tl.program_id(0) * N + offs, x)


@triton.jit
def _failing_kernel(x_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(x_ptr + offs, _inner(tl.load(x_ptr + offs)) + tl.zeros((2 * N,), tl.float32))  # shapes do not match


def _reference(x: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        x = x * 2 + 1
    return torch.where(x > 100, x - 100, x)


def _walks_while(monkeypatch, launch) -> int:
    from triton.runtime import interpreter

    walks = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *args: (walks.append(1), original(*args))[1])
    launch()
    monkeypatch.undo()
    return len(walks)


def _patches_per_launch(monkeypatch, steps: int) -> int:
    x = torch.randn(3, 16)
    out = torch.empty_like(x)
    walks = _walks_while(monkeypatch, lambda: _steps_kernel[(3,)](x, out, 16, steps))
    assert torch.equal(out, _reference(x, steps))
    return walks


def _standard_patches_per_launch(monkeypatch, steps: int) -> int:
    x = torch.randn(3, 16)
    out = torch.empty_like(x)
    walks = _walks_while(monkeypatch, lambda: _standard_kernel[(3,)](x, out, 16, steps))
    expected = x.clone()
    for _ in range(steps):
        expected = expected - expected.sum(dim=1, keepdim=True) / 8
    torch.testing.assert_close(out, expected)
    return walks


def test_the_interpreter_is_patched():
    from triton.runtime import interpreter

    assert triton_interpreter_patch.install()  # already installed by conftest: says so, installs nothing twice
    assert interpreter._patch_lang.skips_nested


def test_nested_helpers_compute_as_before_and_patch_once_per_launch(monkeypatch):
    no_nesting = _patches_per_launch(monkeypatch, 0)
    assert no_nesting > 0
    # 3 programs x (1 _outer + 7 _inner calls) nested calls: the plain interpreter walks the language 24 more times
    assert _patches_per_launch(monkeypatch, 7) == no_nesting


def test_tritons_own_helpers_patch_the_module_they_see_once_per_launch(monkeypatch):
    # a first launch: the interpreter's rewrite of tl.sum puts `tl` into its module's globals, a module more to patch
    _standard_patches_per_launch(monkeypatch, 1)
    once = _standard_patches_per_launch(monkeypatch, 1)
    # 3 programs x 7 x (tl.sum + tl.cdiv): the plain interpreter walks every language module at each of the 42 calls
    assert _standard_patches_per_launch(monkeypatch, 7) == once


def test_builtins_are_tritons_own_after_a_launch_and_after_a_failed_one():
    from triton.runtime import interpreter

    load, add, where = tl.load, tl.tensor.__add__, tl.where
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty_like(x)
    _steps_kernel[(1,)](x, out, 8, 3)
    assert torch.equal(out, _reference(x, 3))
    assert (tl.load, tl.tensor.__add__, tl.where) == (load, add, where)
    with pytest.raises(interpreter.InterpreterError):
        _failing_kernel[(1,)](x, 8)
    assert (tl.load, tl.tensor.__add__, tl.where) == (load, add, where)
    assert not triton_interpreter_patch._state.active
    _steps_kernel[(1,)](x, out, 8, 2)  # the next launch patches and computes as usual
    assert torch.equal(out, _reference(x, 2))
