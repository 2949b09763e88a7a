"""AdamW whose step is one Triton launch per parameter group and dtype.

The update is torch.optim.AdamW's (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019):

    p <- p * (1 - lr * wd)
    m <- b1 * m + (1 - b1) * g,   v <- b2 * v + (1 - b2) * g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

A plain PyTorch step makes several passes over memory per tensor (one per elementwise op, or a few with
``foreach``). Here every element of param, grad, exp_avg and exp_avg_sq is read once and param, exp_avg and
exp_avg_sq are written once, for all tensors of a group in a single launch: a device table holds each tensor's
addresses and size, and a program map says which tensor each program works on; a program walks
``elements_per_program`` consecutive elements of its tensor in blocks of 2048, so the table lookups and the
bias-correction arithmetic are paid once per chunk, not once per block. The table is rebuilt only when an
address changes (grads re-allocated, say). Step counts live on the device as the per-parameter float32 'step'
tensors of torch.optim.AdamW's state layout, and bias correction is computed in the kernel from them (in
float64), so a step never synchronizes with the host. Moments are float32 for float32, bfloat16 and float16
parameters; the update is computed in float32 and rounded once to the parameter dtype.

    opt = FusedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import torch
import triton
import triton.language as tl

from cs336_kernels.interpreter import check_bf16, check_device
from cs336_kernels.ops._common import device_context

# Elements per loop iteration: 8 values per thread at 8 warps, two 16-byte fp32 loads per array. At 16 per thread
# the compiler needs over 200 registers and one program fills an SM; at 8 it needs 64 (ptxas -v, sm_90a), so four
# programs share an SM and one's table lookups and arithmetic hide behind the others' memory traffic.
_BLOCK = 2048
_NUM_WARPS = 8
# Columns of the per-tensor table: param, grad, exp_avg, exp_avg_sq and step addresses, numel, first program.
_TABLE_COLUMNS = 7
_PARAM_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _int_pow(base, exponent):
    """base ** exponent for a float64 base and an int32 exponent in [0, 2**31), by repeated squaring."""
    result = base * 0.0 + 1.0
    for _ in range(31):
        result = tl.where((exponent & 1) == 1, result * base, result)
        base = base * base
        exponent = exponent >> 1
    return result


@triton.jit
def _adamw_update(p, g, m, v, decay, beta1, beta2, step_size, bias_correction2_sqrt, eps):
    p = p.to(tl.float32) * decay
    g = g.to(tl.float32)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    return p, m, v


@triton.jit
def _fused_adamw_kernel(
    TABLE,  # int64 (num_tensors, 7): addresses of param, grad, exp_avg, exp_avg_sq, step; numel; first program
    PROGRAM_MAP,  # int64 (num_programs,): which tensor each program updates
    HYPER,  # float64 (5,): lr, beta1, beta2, eps, weight_decay
    PARAM_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address is a multiple of 16 bytes, so loads can be 16 bytes wide
    BLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
):
    pid = tl.program_id(0)
    row = TABLE + tl.load(PROGRAM_MAP + pid) * 7
    p_addr = tl.load(row + 0)
    g_addr = tl.load(row + 1)
    m_addr = tl.load(row + 2)
    v_addr = tl.load(row + 3)
    step_addr = tl.load(row + 4)
    numel = tl.load(row + 5)
    start = (pid - tl.load(row + 6)) * (BLOCK * BLOCKS_PER_PROGRAM)
    end = tl.minimum(start + BLOCK * BLOCKS_PER_PROGRAM, numel)
    P = p_addr.to(tl.pointer_type(PARAM_DTYPE))
    G = g_addr.to(tl.pointer_type(PARAM_DTYPE))
    M = m_addr.to(tl.pointer_type(tl.float32))
    V = v_addr.to(tl.pointer_type(tl.float32))
    if ALIGNED:
        # Addresses read from memory carry no alignment facts; without these hints every access is 4 bytes.
        P = tl.multiple_of(P, 16)
        G = tl.multiple_of(G, 16)
        M = tl.multiple_of(M, 16)
        V = tl.multiple_of(V, 16)
    STEP = step_addr.to(tl.pointer_type(tl.float32))

    # Scalars in float64: 1 - b2^t at t = 1 is 1e-3, and float32 would keep only four digits of it.
    lr = tl.load(HYPER + 0)
    beta1 = tl.load(HYPER + 1)
    beta2 = tl.load(HYPER + 2)
    eps = tl.load(HYPER + 3)
    weight_decay = tl.load(HYPER + 4)
    step = tl.load(STEP).to(tl.int32)
    bias_correction1 = 1.0 - _int_pow(beta1, step)
    bias_correction2 = 1.0 - _int_pow(beta2, step)
    step_size = (lr / bias_correction1).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(bias_correction2).to(tl.float32)
    decay = (1.0 - lr * weight_decay).to(tl.float32)
    beta1 = beta1.to(tl.float32)
    beta2 = beta2.to(tl.float32)
    eps = eps.to(tl.float32)

    for block_start in range(start, end, BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        if block_start + BLOCK <= numel:
            # Full block: no mask, so the accesses vectorize.
            p, m, v = _adamw_update(tl.load(P + offs), tl.load(G + offs), tl.load(M + offs), tl.load(V + offs),
                                    decay, beta1, beta2, step_size, bias_correction2_sqrt, eps)
            tl.store(P + offs, p.to(PARAM_DTYPE))
            tl.store(M + offs, m)
            tl.store(V + offs, v)
        else:
            mask = offs < numel
            p, m, v = _adamw_update(tl.load(P + offs, mask=mask), tl.load(G + offs, mask=mask),
                                    tl.load(M + offs, mask=mask), tl.load(V + offs, mask=mask),
                                    decay, beta1, beta2, step_size, bias_correction2_sqrt, eps)
            tl.store(P + offs, p.to(PARAM_DTYPE), mask=mask)
            tl.store(M + offs, m, mask=mask)
            tl.store(V + offs, v, mask=mask)


# Device tables by the tensors' addresses and sizes (and the launch granularity), and hyperparameter tensors by
# their values: a step that sees the same tensors as an earlier one reuses its table. The least recently used
# entry goes first, so tables of re-allocated gradients do not pile up.
_CACHE_SIZE = 16
_tables: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()
_hypers: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()


def _cached(cache: collections.OrderedDict, key: tuple, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    cache[key] = value = build()
    if len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)
    return value


def _device_table(rows: list[tuple[int, ...]], blocks_per_program: int, device: torch.device) -> torch.Tensor:
    """The int64 table (num_tensors, 7) followed by the program map, on ``device``."""
    numels = torch.tensor([r[5] for r in rows], dtype=torch.int64)
    chunk = _BLOCK * blocks_per_program
    num_programs = (numels + chunk - 1) // chunk
    first_program = torch.cumsum(num_programs, 0) - num_programs
    table = torch.tensor([r[:6] for r in rows], dtype=torch.int64)
    table = torch.cat([table, first_program[:, None]], dim=1)  # (num_tensors, 7)
    program_map = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int64), num_programs)
    # One host-to-device copy; from pageable memory it is staged, so the host does not wait for the GPU.
    return torch.cat([table.reshape(-1), program_map]).to(device, non_blocking=True)


@torch.library.custom_op("cs336::fused_adamw_step",
                         mutates_args=("params", "exp_avgs", "exp_avg_sqs", "steps"))
def fused_adamw_step_op(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                        exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], lr: float, beta1: float,
                        beta2: float, eps: float, weight_decay: float, blocks_per_program: int) -> None:
    """One AdamW step, in place, for contiguous ``params`` of one dtype and device with their contiguous ``grads``
    (that dtype), fp32 moments and fp32 0-d ``steps`` (each incremented first), in one launch, as
    ``torch.ops.cs336.fused_adamw_step``."""
    if not params:
        return
    device, dtype = params[0].device, params[0].dtype
    torch._foreach_add_(steps, 1.0)
    rows = [(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), t.data_ptr(), p.numel())
            for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True)]
    packed = _cached(_tables, (device, blocks_per_program, *rows),
                     lambda: _device_table(rows, blocks_per_program, device))
    table = packed[: len(rows) * _TABLE_COLUMNS]
    program_map = packed[len(rows) * _TABLE_COLUMNS :]
    aligned = all(addr % 16 == 0 for r in rows for addr in r[:4])
    values = (lr, beta1, beta2, eps, weight_decay)
    hyper = _cached(_hypers, (device, *values),
                    lambda: torch.tensor(values, dtype=torch.float64).to(device, non_blocking=True))
    with device_context(params[0]):
        _fused_adamw_kernel[(program_map.numel(),)](
            table, program_map, hyper, PARAM_DTYPE=_PARAM_DTYPES[dtype], ALIGNED=aligned, BLOCK=_BLOCK,
            BLOCKS_PER_PROGRAM=blocks_per_program, num_warps=_NUM_WARPS,
        )


@fused_adamw_step_op.register_fake
def _(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
      exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
      weight_decay: float, blocks_per_program: int) -> None:
    return None


def _check_hyperparameters(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr >= 0.0:
        raise ValueError(f"lr must be a non-negative Python number, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}] must be a number in [0, 1), got {beta!r}")
    if not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be a non-negative number, got {weight_decay!r}")


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with a fused Triton step; state layout of torch.optim.AdamW.

    Args:
        params: tensors or parameter groups (dicts), as for any torch optimizer. Each group's tensors must be
            on one device, contiguous, and float32, bfloat16 or float16.
        lr, betas, eps, weight_decay: as torch.optim.AdamW; each group may override them.
        elements_per_program: launch granularity, a multiple of 2048. Larger spreads the per-program table
            lookups over more elements; smaller gives small tensors more programs.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        elements_per_program: int = 16 * _BLOCK,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if not isinstance(elements_per_program, int) or elements_per_program < 1 or elements_per_program % _BLOCK:
            raise ValueError(f"elements_per_program must be a positive multiple of {_BLOCK}, "
                             f"got {elements_per_program!r}")
        self._blocks_per_program = elements_per_program // _BLOCK
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        devices = {p.device for p in group["params"]}
        if len(devices) > 1:
            raise ValueError(f"FusedAdamW needs every tensor of a parameter group on one device, got {devices}")
        for device in devices:
            check_device(device, "FusedAdamW")
        for dtype in {p.dtype for p in group["params"]}:
            check_bf16(next(iter(devices)), dtype, "FusedAdamW", "it truncates the updated bf16 parameters where a GPU "
                       "rounds to nearest, so every step would shrink them toward zero")
        for p in group["params"]:
            if p.dtype not in _PARAM_DTYPES:
                raise TypeError(
                    f"FusedAdamW supports parameters of dtype {sorted(map(str, _PARAM_DTYPES))}, got {p.dtype}"
                )
            if not p.is_contiguous():
                raise ValueError(f"FusedAdamW updates parameters in place and needs them contiguous, "
                                 f"got shape {tuple(p.shape)} with strides {p.stride()}")

    def _state_for(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step for every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            buckets: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("FusedAdamW does not support sparse gradients")
                if p.grad.dtype != p.dtype or p.grad.device != p.device:
                    raise TypeError(f"gradient must match its parameter's dtype and device: parameter "
                                    f"{p.dtype} on {p.device}, gradient {p.grad.dtype} on {p.grad.device}")
                buckets.setdefault(p.dtype, []).append(p)
            for params in buckets.values():
                self._step_bucket(group, params)
        return loss

    def _step_bucket(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        # Non-contiguous grads are copied for the launch.
        grads = [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in params]
        states = [self._state_for(p) for p in params]
        fused_adamw_step_op(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                            [s["step"] for s in states], float(group["lr"]), float(group["betas"][0]),
                            float(group["betas"][1]), float(group["eps"]), float(group["weight_decay"]),
                            self._blocks_per_program)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a FusedAdamW or torch.optim.AdamW state dict, keeping moments in float32 on each param's device.

        Optimizer.load_state_dict would cast the moments to the parameter dtype (bfloat16, say), so the groups
        go through it and the per-parameter state is placed here.
        """
        for group in state_dict["param_groups"]:
            for flag in ("amsgrad", "maximize"):
                if group.get(flag, False):
                    raise ValueError(f"FusedAdamW cannot continue a run with {flag}=True")
        super().load_state_dict({**state_dict, "state": {}})
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(i)
            if not saved:
                continue
            missing = {"step", "exp_avg", "exp_avg_sq"} - set(saved)
            if missing:
                raise ValueError(f"state of parameter {i} lacks {sorted(missing)}; keys given: {sorted(saved)}")
            self.state[p] = {
                "step": torch.as_tensor(saved["step"], dtype=torch.float32).to(p.device, copy=True).reshape(()),
                "exp_avg": saved["exp_avg"].to(p.device, torch.float32, copy=True).contiguous(),
                "exp_avg_sq": saved["exp_avg_sq"].to(p.device, torch.float32, copy=True).contiguous(),
            }
