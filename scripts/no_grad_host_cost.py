"""Host time per call under torch.no_grad() of the SEBP ops against torch's own (tiny CPU tensors, 1 thread:
the call overhead alone). Run it on two commits to compare.

    python scripts/no_grad_host_cost.py
"""
import torch, time
from sebp_kernels import SEBPLinear
from sebp_kernels.activations import sebp_gelu
from sebp_kernels.norms import sebp_layer_norm
torch.set_num_threads(1)
lin=torch.nn.Linear(64,64); s=SEBPLinear.from_linear(torch.nn.Linear(64,64))
x=torch.randn(4,64); w=torch.randn(64); b=torch.randn(64)
def t(f,n=20000):
    for _ in range(500): f()
    best=1e9
    for r in range(5):
        t0=time.perf_counter()
        for _ in range(n): f()
        best=min(best,(time.perf_counter()-t0)/n*1e6)
    return best
with torch.no_grad():
    print("no_grad: nn.Linear %.1f us, SEBPLinear %.1f us, F.layer_norm %.1f, sebp_layer_norm %.1f, F.gelu %.1f, sebp_gelu %.1f" % (
        t(lambda: lin(x)), t(lambda: s(x)), t(lambda: torch.nn.functional.layer_norm(x,(64,),w,b)), t(lambda: sebp_layer_norm(x,(64,),w,b)),
        t(lambda: torch.nn.functional.gelu(x)), t(lambda: sebp_gelu(x))))
