"""Quick CUDA smoke test of the core (correctness + a transfer-bound timing), for early device runs."""
import copy, time, torch, torch.nn as nn
import offtensor
from torch.utils.checkpoint import checkpoint

torch.manual_seed(0)
dev = "cuda"

class Block(nn.Module):
    def __init__(s, d, f): super().__init__(); s.ln = nn.LayerNorm(d); s.up = nn.Linear(d, f, bias=False); s.down = nn.Linear(f, d, bias=False)
    def forward(s, x): return x + s.down(torch.nn.functional.silu(s.up(s.ln(x))))

class M(nn.Module):
    def __init__(s, d, f, n, ck=None): super().__init__(); s.ck = ck; s.inp = nn.Linear(d, d); s.blocks = nn.ModuleList([Block(d, f) for _ in range(n)]); s.head = nn.Linear(d, 8)
    def forward(s, x):
        x = s.inp(x)
        for b in s.blocks: x = b(x) if s.ck is None else checkpoint(b, x, use_reentrant=s.ck)
        return s.head(x)

print(torch.__version__, torch.cuda.get_device_name())
for ck in [None, False, True]:
    torch.manual_seed(0)
    m = M(256, 1024, 4, ck); ref = copy.deepcopy(m).to(dev)
    offtensor.wrap(m); m.to(dev)
    print("pinned:", m.blocks[0].up.weight.is_pinned(), m.blocks[0].up.weight.device)
    o = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True); orf = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x = torch.randn(4, 256, device=dev)
    for step in range(3):
        for mb in range(2):
            y = m(x + mb); yr = ref(x + mb)
            torch.testing.assert_close(y, yr)
            y.square().mean().backward(); yr.square().mean().backward()
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.to(dev), q.grad, msg=n)
        o.step(); orf.step(); o.zero_grad(); orf.zero_grad()
    print("ck", ck, "parity ok", {s.state.name for s in offtensor.summary(m).scopes}, torch.cuda.memory_allocated() / 2**20, "MiB")

# transfer-bound timing: 8 blocks of ~436 MB bf16 each
d, f, n = 4096, 14336, 8
with torch.device("meta"):
    m = M(d, f, n)
m = m.to_empty(device="cpu").to(torch.bfloat16)
for p in m.parameters(): p.data.normal_(0, 0.02)
x = torch.randn(1, 512, d, device=dev, dtype=torch.bfloat16)
nbytes = sum(p.numel() * 2 for p in m.blocks.parameters())
buf = torch.empty(nbytes // 8, dtype=torch.uint8, pin_memory=True); dbuf = torch.empty_like(buf, device=dev)
for _ in range(3): dbuf.copy_(buf, non_blocking=True)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(10): dbuf.copy_(buf, non_blocking=True)
torch.cuda.synchronize(); bw = 10 * buf.numel() / (time.perf_counter() - t)
print(f"h2d bandwidth {bw / 1e9:.1f} GB/s; floor {nbytes / bw * 1e3:.1f} ms")
t = time.perf_counter(); offtensor.wrap(m); m.to(dev); print(f"wrap {time.perf_counter() - t:.1f}s")
with torch.no_grad():
    for i in range(6):
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); t = time.perf_counter()
        m(x); torch.cuda.synchronize(); dt = time.perf_counter() - t
        print(f"infer 1x512: {dt * 1e3:.1f} ms ratio {dt / (nbytes / bw):.3f} peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
