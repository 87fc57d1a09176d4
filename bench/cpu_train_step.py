"""A 2-layer transformer training step on the CPU (B 4, S 256, d_model 256, 4 heads, causal),
median of 30 steps after 5, with SDPA or flashattn.torch.attention as the attention:
    python bench/cpu_train_step.py sdpa|ours [batch]
FLASHATTN_TORCH_THREADS=1 runs flashattn's CPU calls on torch's OpenMP threads
(flashattn.torch.use_torch_threads); compare the two at equal torch.get_num_threads()."""
import torch, time, sys, statistics
import torch.nn as nn, torch.nn.functional as F
import flashattn.torch as fat
torch.manual_seed(0)
B,S,Dm,H=int(sys.argv[2]) if len(sys.argv)>2 else 4,256,256,4
class Block(nn.Module):
    def __init__(s, attn):
        super().__init__(); s.qkv=nn.Linear(Dm,3*Dm); s.o=nn.Linear(Dm,Dm); s.ff=nn.Sequential(nn.Linear(Dm,4*Dm),nn.GELU(),nn.Linear(4*Dm,Dm)); s.n1=nn.LayerNorm(Dm); s.n2=nn.LayerNorm(Dm); s.attn=attn
    def forward(s,x):
        q,k,v=s.qkv(s.n1(x)).view(B,S,3,H,Dm//H).unbind(2)
        a=s.attn(q.transpose(1,2),k.transpose(1,2),v.transpose(1,2)).transpose(1,2).reshape(B,S,Dm)
        x=x+s.o(a); return x+s.ff(s.n2(x))
sdpa=lambda q,k,v: F.scaled_dot_product_attention(q,k,v,is_causal=True)
ours=lambda q,k,v: fat.attention(q,k,v,is_causal=True)
which=sys.argv[1]
m=nn.Sequential(Block(sdpa if which=="sdpa" else ours),Block(sdpa if which=="sdpa" else ours))
x=torch.randn(B,S,Dm)
opt=torch.optim.SGD(m.parameters(),lr=1e-3)
def step():
    opt.zero_grad(); m(x).square().mean().backward(); opt.step()
for _ in range(5): step()
ts=[]
for _ in range(30):
    t0=time.perf_counter(); step(); ts.append(time.perf_counter()-t0)
print(which, "threads", torch.get_num_threads(), "median ms %.2f" % (statistics.median(ts)*1e3))
