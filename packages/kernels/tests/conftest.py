"""Test-only emulation of one Triton interpreter method the kernels need on CPU.

Why it exists: Triton 3.6's interpreter (``TRITON_INTERPRET=1``) runs tensor-descriptor loads and stores
but not descriptor reductions, so ``desc.atomic_add(...)`` fails there with "'InterpreterBuilder' object
has no attribute 'create_descriptor_reduce'". The flash-attention backward with ``deterministic=False``
adds its fp32 dQ tiles with exactly that call (a TMA reduce-add on the GPU); without this emulation that
path would have no CPU tests. It covers only what the kernel uses, an fp32 add, as element-wise relaxed
atomics over the block's in-bounds elements (what the copy engine does: out-of-bounds rows are dropped).
It is installed only when the interpreter runs and lacks the method; delete this file once Triton's
interpreter implements ``create_descriptor_reduce``.
"""

from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    if not hasattr(interpreter.InterpreterBuilder, "create_descriptor_reduce"):

        def _create_descriptor_reduce(self, kind, desc, value, indices):
            if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD or value.dtype.scalar.name != "fp32":
                raise NotImplementedError(
                    f"test emulation of create_descriptor_reduce covers fp32 add only, got {kind} of {value.dtype}"
                )
            ptrs, mask = desc.materialize_pointers(indices)
            mask = interpreter.TensorHandle(mask, interpreter.tl.int1)
            return self.create_atomic_rmw(
                ir.ATOMIC_OP.FADD, ptrs, value, mask, ir.MEM_SEMANTIC.RELAXED, ir.MEM_SYNC_SCOPE.GPU
            )

        interpreter.InterpreterBuilder.create_descriptor_reduce = _create_descriptor_reduce
