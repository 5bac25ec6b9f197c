import torch
from sebp_probe.hooks import reduce_grad, GradientStatsCollector
from scripts.collector_overhead import SHAPES, batches
torch.manual_seed(0)
g = torch.randn(4096, 1536) * torch.logspace(-12, 2, 1536); g[::3] = 0; g[5, 7] = float("nan")
for dt in (torch.float32, torch.bfloat16, torch.float16):
    a = [x if isinstance(x, int) else x.cpu() for x in reduce_grad(g.to(dt).cuda())]
    b = reduce_grad(g.to(dt))
    ok = a[:2] == list(b[:2]) and all(torch.equal(x, y) for x, y in zip(a[2:], b[2:]))
    print("device == cpu reduction", dt, ok)
m = SHAPES["minilm"]().cuda(); m.train()
bt = {k: v.cuda() for k, v in batches("minilm", 1, 32, 128, "right")[0].items()}
with GradientStatsCollector(m) as col:
    with col.batch(bt["attention_mask"]):
        loss = m(**bt).loss
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
            print("backward with collector: no host sync")
        finally:
            torch.cuda.set_sync_debug_mode(0)
st = col.stats()
print("zero rows layer0 query", st.layers["bert.encoder.layer.0.attention.self.query"].zero_rows, "pad", int((bt["attention_mask"]==0).sum()))
