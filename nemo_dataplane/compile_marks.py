"""tensordict's torch.compile marks, applied when ``torch._dynamo`` loads instead of at import.

tensordict marks a few of its functions for ``torch.compile`` while it imports
(``torch.compiler.allow_in_graph``, ``torch.compiler.assume_constant_result``), and each mark
imports ``torch._dynamo``: about 2 CPU-seconds in every process that imports tensordict, the
store's actors included, which never compile. Both marks only register the function and return
it unchanged, so they can wait: while tensordict imports, they are recorded; the moment
``torch._dynamo`` is imported in that process (which ``torch.compile`` does before it traces
anything), the real functions apply them, in order. A process that had loaded ``torch._dynamo``
before tensordict imports it unchanged. :func:`defer_tensordict_compile_marks` is called by
``nemo_dataplane``'s ``__init__``, which every process of the library and its trainers imports
first; it imports nothing itself.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["MARKS", "defer_tensordict_compile_marks", "pending_marks"]

MARKS = ("allow_in_graph", "assume_constant_result")
_lock = threading.RLock()
_pending: list[tuple[str, Any]] = []
_recording = False
_real: dict[str, Callable[[Any], Any]] = {}


def pending_marks() -> list[tuple[str, str]]:
    """(mark, function name) recorded and not applied yet: empty once ``torch._dynamo`` loaded."""
    with _lock:
        return [(mark, getattr(fn, "__qualname__", repr(fn))) for mark, fn in _pending]


def _recorder(mark: str) -> Callable[[Any], Any]:
    def record(fn: Any) -> Any:
        with _lock:
            if not _recording:  # a call after tensordict imported: the real mark, as it was
                return _real[mark](fn)
            fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
            _pending.extend((mark, f) for f in fns)
            return fns if isinstance(fn, (list, tuple)) else fn

    record.__name__ = record.__qualname__ = mark
    return record


def _start_recording() -> None:
    global _recording
    import torch.compiler  # tensordict imports torch first anyway

    with _lock:
        for mark in MARKS:
            _real.setdefault(mark, getattr(torch.compiler, mark))
            setattr(torch.compiler, mark, _recorder(mark))
        _recording = True


def _stop_recording() -> None:
    global _recording
    import torch.compiler

    with _lock:
        _recording = False
        for mark in MARKS:
            if getattr(getattr(torch.compiler, mark), "__module__", None) == __name__:
                setattr(torch.compiler, mark, _real[mark])
    if "torch._dynamo" in sys.modules:  # something loaded it meanwhile
        _apply_pending()


def _apply_pending() -> None:
    with _lock:
        todo, _pending[:] = list(_pending), []
    for mark, fn in todo:
        _real[mark](fn)


class _Hook(importlib.abc.MetaPathFinder):
    """Wraps the import of ``tensordict`` (record the marks) and of ``torch._dynamo`` (apply them)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        around: Callable[[Callable[[ModuleType], None], ModuleType], None]
        if fullname == "tensordict" and "torch._dynamo" not in sys.modules:
            around = _recording_import
        elif fullname == "torch._dynamo" and _pending:
            around = _marking_import
        else:
            return None
        spec = _spec_from_others(self, fullname, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            # This spec's own loader object: no other import sees the wrapper.
            spec.loader.exec_module = functools.partial(around, spec.loader.exec_module)  # type: ignore[method-assign]
        return spec


def _recording_import(run: Callable[[ModuleType], None], module: ModuleType) -> None:
    _start_recording()
    try:
        run(module)
    finally:
        _stop_recording()


def _marking_import(run: Callable[[ModuleType], None], module: ModuleType) -> None:
    run(module)
    _apply_pending()  # only once it imported: the marks need it whole


def _spec_from_others(
    me: _Hook, fullname: str, path: Sequence[str] | None, target: ModuleType | None
) -> importlib.machinery.ModuleSpec | None:
    for finder in sys.meta_path:
        if finder is me or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def defer_tensordict_compile_marks() -> None:
    """Install the import hook once; a no-op when tensordict is already imported."""
    if "tensordict" in sys.modules or any(isinstance(f, _Hook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Hook())
