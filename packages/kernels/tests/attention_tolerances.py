"""The attention tests' tolerances, one place for the Triton and the Gluon kernels: relative Frobenius error of O,
dQ, dK, dV against float64 on the same rounded inputs (P and dS are rounded to the input dtype before their
products), and absolute error of the logsumexp L."""

import torch

REL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
LSE_TOL = {torch.float32: 2e-5, torch.float16: 2e-4, torch.bfloat16: 2e-4}
