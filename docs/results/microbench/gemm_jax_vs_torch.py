"""f32 prefill-shaped products (1024 tokens x Qwen2.5-0.5B layer shapes): jax (XLA:CPU) vs torch (oneDNN), GF/s.

NT = HF's weight[out, in] layout (kvjax's), NN = weight[in, out]. Best of 5 after a warm-up.
XLA_FLAGS from the environment apply. Run: python docs/results/microbench/gemm_jax_vs_torch.py
"""
import os
import time, numpy as np, jax, jax.numpy as jnp, torch
torch.set_num_threads(os.cpu_count())
print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
def tj(f, *a, n=5):
    f(*a).block_until_ready(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(*a).block_until_ready(); ts.append(time.perf_counter()-t)
    return min(ts)
def tt(f, *a, n=5):
    f(*a); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(*a); ts.append(time.perf_counter()-t)
    return min(ts)
T=1024
for (din,dout) in [(896,9728),(4864,896),(896,1152)]:
    x=np.random.randn(T,din).astype(np.float32); w=np.random.randn(dout,din).astype(np.float32)
    fl=2*T*din*dout
    nt=jax.jit(lambda x,w: jax.lax.dot_general(x,w,(((1,),(1,)),((),()))))
    nn=jax.jit(lambda x,w: x@w)
    a=tj(nt,jnp.asarray(x),jnp.asarray(w)); b=tj(nn,jnp.asarray(x),jnp.asarray(w.T.copy()))
    with torch.inference_mode():
        c=tt(torch.nn.functional.linear, torch.from_numpy(x), torch.from_numpy(w))
    print(f"{din}->{dout}: jax NT {fl/a/1e9:.0f} GF/s, jax NN {fl/b/1e9:.0f} GF/s, torch {fl/c/1e9:.0f} GF/s")
