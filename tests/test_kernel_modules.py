"""``cs336_kernels.nn``'s modules and ``cs336_basics.model``'s share state dicts: each loads the other's, and the
two compute the same function (fp32; the kernels run in Triton's interpreter on CPU)."""

import pytest
import torch
from cs336_basics import model as basics
from cs336_kernels import nn as knn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The kernels compute in fp32 with their own summation orders; the model in PyTorch's.
REL_TOL = 1e-5


def _pairs():
    rope = basics.RotaryEmbedding(24, 16, 10000.0, device=DEVICE)
    return [
        pytest.param(lambda: basics.RMSNorm(32, device=DEVICE), lambda: knn.RMSNorm(32, device=DEVICE), id="rms_norm"),
        pytest.param(lambda: basics.SwiGLU(32, 48, device=DEVICE), lambda: knn.SwiGLU(32, 48, device=DEVICE),
                     id="swiglu"),
        pytest.param(lambda: basics.CausalMultiHeadSelfAttention(32, 2, rope, device=DEVICE),
                     lambda: knn.CausalSelfAttention(32, 2, 24, device=DEVICE), id="attention"),
    ]


@pytest.mark.parametrize(("make_basics", "make_ours"), _pairs())
def test_state_dicts_load_both_ways_and_modules_agree(make_basics, make_ours):
    torch.manual_seed(0)
    theirs, ours = make_basics(), make_ours()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms start at ones: move them off
    ours.load_state_dict(theirs.state_dict())
    make_basics().load_state_dict(ours.state_dict())
    x = torch.randn(2, 19, 32, device=DEVICE)
    expected = theirs(x)
    assert ((ours(x) - expected).norm() / expected.norm()).item() < REL_TOL
