"""Counting the ATen operators a piece of code dispatches, under torch's dispatch mode."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class DispatchCount(TorchDispatchMode):
    """How many times the operators named (``aten::mm``, overloads alike) were dispatched inside the ``with``.

    Usage::

        with DispatchCount("aten::_to_copy") as casts:
            model(**batch).loss.backward()
        casts.count
    """

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names = frozenset(names)
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.name() in self.names
        return func(*args, **(kwargs or {}))
