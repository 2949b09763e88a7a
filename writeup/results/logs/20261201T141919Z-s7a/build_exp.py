"""Offline sm_90 builds of the experimental backward variants."""
import math, re, sys
sys.path.insert(0, "scratch"); sys.path.insert(0, "tools")
import torch
from gluon_attention_builds import _compile
import gluon_bwd_exp as ex
from cs336_kernels.sass import loop_spills
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

def args_for(head_dim, ld, dqb, stages):
    q = torch.zeros(1, 4, 1024, head_dim, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 1024, head_dim, dtype=torch.bfloat16)
    lse = torch.zeros(1, 4, 1024)
    bm, bn, st = ex.CONFIGS[head_dim]
    dq_block = [1, 1, bm, head_dim // 2 if head_dim == 128 else head_dim]
    dqa = q.float()
    dq_desc = TensorDescriptor.from_tensor(dqa, dq_block, gl.NVMMASharedLayout.get_default_for(dq_block, gl.float32))
    args = (ex.descriptor(q, bm), ex.descriptor(k, bn), ex.descriptor(k, bn), ex.descriptor(q, bm), dq_desc,
            ex._row_desc(lse, bm), ex._row_desc(lse, bm), lse, lse, k, k, 2, 2, 1024, 1024, 0.1, 0.1)
    const = {"HEAD_DIM": head_dim, "BLOCK_M": bm, "BLOCK_N": bn, "STAGES": stages or st, "IS_CAUSAL": True,
             "LD_SMEM": ld, "DQ_BUFS": dqb}
    return args, const

for d, ld, dqb, st in [(128, False, 1, None), (128, True, 1, None), (128, True, 2, None), (128, True, 1, 3),
                       (64, False, 1, None), (64, True, 1, None), (64, True, 2, None), (64, True, 1, 4)]:
    try:
        args, const = args_for(d, ld, dqb, st)
        compiled, sass = _compile(ex._attn_bwd_kernel, args, const)
        print(d, ld, dqb, st, "maxreg", max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)), "shared",
              compiled.metadata.shared, "STL", sass.count("STL"), "LDL", sass.count("LDL"), "loops", loop_spills(sass),
              "UTMALDG", sass.count("UTMALDG"), flush=True)
    except Exception as e:
        print(d, ld, dqb, st, "FAILED", type(e).__name__, str(e)[:800], flush=True)
