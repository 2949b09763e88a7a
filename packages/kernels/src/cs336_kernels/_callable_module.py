"""Modules that can be called as the function they are named after.

``cs336_kernels`` exports ``flash_attention`` and ``fused_linear_cross_entropy`` at the top level, and
each is also the name of a submodule. Python binds a package attribute to a submodule when the submodule
is imported, and ``import cs336_kernels.flash_attention as fa`` reads that attribute, so one name must
serve as both: the submodule itself, made callable as its function.
"""

from __future__ import annotations

import types
from typing import Any


class CallableModule(types.ModuleType):
    """A module whose call is its own function of the same name (``cs336_kernels.flash_attention(q, k, v)``
    calls ``cs336_kernels.flash_attention.flash_attention``). Set as ``sys.modules[__name__].__class__``,
    the way the Python data model documents for customising a module."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)
