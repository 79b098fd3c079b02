"""Bytes autograd saves for backward (unique storages) in one training forward: eager recipe vs fuseforge recipe,
Llama shapes of issue 7 with 1 and 2 layers (the difference is one layer) and a short sequence, on
the CPU: a dev measurement that predicts the e2e peak-memory ratio without a GPU, not a benchmark.
    python scripts/e2e_activation_bytes.py [seq]
"""
import sys, torch
import os
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks")); sys.path.insert(0, os.path.join(ROOT, "python"))
import fuseforge
from fuseforge.patch import patch
import bench_e2e as B

def saved_bytes(model, fn):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape[::-1]) for p in model.parameters()}
    seen, casts = {}, {}
    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() in params:
            return t
        (casts if tuple(t.shape) in shapes and t.dim() == 2 else seen)[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    return sum(seen.values()), sum(casts.values())

seq = int(sys.argv[1]) if len(sys.argv) > 1 else 128
res = {}
for layers in (1, 2):
    cfg = dict(B.CONFIGS["1b"], num_hidden_layers=layers)
    ids = torch.randint(0, cfg["vocab_size"], (1, seq))
    m = B.build_model(cfg, seq, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        e = saved_bytes(m, lambda: m(input_ids=ids, labels=ids).loss)
    m = patch(B.cast_parameters(m, torch.bfloat16))
    f = saved_bytes(m, lambda: m(input_ids=ids, labels=ids).loss)
    res[layers] = (e, f)
    print(f"layers {layers} seq {seq}: eager act {e[0]/2**20:.1f} MiB + weight casts {e[1]/2**20:.1f} MiB; fuseforge act {f[0]/2**20:.1f} MiB + {f[1]/2**20:.1f}", flush=True)
    del m
(e1, f1), (e2, f2) = res[1], res[2]
per_layer_e, per_layer_f = (e2[0] - e1[0]) / seq, (f2[0] - f1[0]) / seq
head_e, head_f = (e1[0] / seq - per_layer_e), (f1[0] / seq - per_layer_f)
print(f"per token per layer: eager {per_layer_e/1024:.1f} KiB, fuseforge {per_layer_f/1024:.1f} KiB")
print(f"per token outside the layers (embedding, norm, head, loss): eager {head_e/1024:.1f} KiB, fuseforge {head_f/1024:.1f} KiB")
for L, T in ((16, 2048),):
    ae = (per_layer_e * L + head_e) * T / 2**30; af = (per_layer_f * L + head_f) * T / 2**30
    print(f"16 layers, a 2048-token sequence: eager {ae:.2f} GiB, fuseforge {af:.2f} GiB saved for backward")
