import sys
sys.path.insert(0, "scratch")
import torch
import gluon_bwd_exp as ex
from cs336_kernels.flash_attention.gluon_forward import gluon_attention_forward
from cs336_kernels.flash_attention.gluon_backward import gluon_attention_backward
b, h, t, d = 1, 32, 8192, int(sys.argv[1])
q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
do = torch.randn_like(q)
o, lse = gluon_attention_forward(q, k, v, True)
gluon_attention_backward(q, k, v, o, do, lse, True)
ex.gluon_attention_backward_exp(q, k, v, o, do, lse, True, ld_smem=True)
torch.cuda.synchronize()
