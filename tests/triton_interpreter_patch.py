"""Triton's CPU interpreter without its per-call re-patching of triton.language, for the tests and the device check's
dry run (never the product: it only ever runs Triton compiled for a GPU).

Under TRITON_INTERPRET=1 a kernel launch swaps triton.language's builtins for interpreted ones (`_patch_lang`),
runs every program of the grid, and swaps them back. Each call of a nested `@triton.jit` helper inside a program
patches again (triton 3.8 `InterpretedFunction.__call__`), walking `inspect.getmembers` over the language modules,
though the launch around it has already patched them: the nested patch finds no builtin left to replace and is
never restored on its own (the launch's restore puts back the originals). That walk was 41% of the word-tile kernel
tests' time. `install()` skips a nested patch whose language modules the running launch has already patched; a
helper that sees a module the launch did not (Triton's own `tl.sum`, `tl.cdiv`, `tl.zeros` see triton.language.core,
which a kernel module importing `triton.language as tl` does not) gets the full patch once, and the launch then counts
that module as patched: before, every such call walked again, 30% of the word-tile tests' time.
PAGEDSERVE_TEST_PLAIN_INTERPRETER=1 leaves Triton's interpreter as shipped (to compare, or to rule this out).
"""

from __future__ import annotations

import inspect
import os
import threading

_state = threading.local()


class _Unpatched:
    """The scope a skipped nested patch returns: nothing to restore."""

    @staticmethod
    def restore() -> None:
        return None


class _LaunchScope:
    """The launch's real scope; restoring it also ends the launch's record of what is patched."""

    def __init__(self, scope):
        self.scope = scope

    def restore(self) -> None:
        try:
            self.scope.restore()
        finally:
            _state.active.pop()


def install() -> bool:
    """Installs the skip into Triton's interpreter; False (nothing changed) where the interpreter lacks the shape it
    was written against, so a Triton upgrade falls back to the plain interpreter instead of breaking the tests. Only
    under TRITON_INTERPRET=1: a GPU run compiles its kernels and never enters the interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("PAGEDSERVE_TEST_PLAIN_INTERPRETER") == "1":
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    launch_call = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    if original is None or launch_call is None or getattr(original, "skips_nested", False):
        return original is not None and getattr(original, "skips_nested", False)
    language, core = interpreter.tl, interpreter.tl.core

    def lang_modules(fn) -> frozenset[int]:
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and (value is language or value is core))

    def patch_lang(fn):
        active = getattr(_state, "active", None)
        if active is None:
            active = _state.active = []
        langs = lang_modules(fn)
        if active and langs <= active[-1]:
            return _Unpatched()
        scope = original(fn)
        if getattr(_state, "launching", False):
            _state.launching = False
            active.append(langs | (active[-1] if active else frozenset()))
            return _LaunchScope(scope)
        if active:
            # A nested helper that sees a module the launch did not (triton.language.standard's tl.sum, tl.cdiv,
            # tl.zeros see triton.language.core) patched it just now, and Triton never restores a nested patch:
            # the module stays patched for the rest of the launch, so its later helpers need no walk either.
            active[-1] = active[-1] | langs
        return scope

    def launch(self, *args, **kwargs):
        _state.launching = True
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            _state.launching = False

    patch_lang.skips_nested = True
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch
    return True
