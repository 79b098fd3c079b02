"""What bf16 logits would cost linear_cross_entropy in accuracy (CPU, no GPU needed).

Emulates the default strategy's arithmetic with the logits kept in float32 (today) or rounded to
bf16 (what a bf16-output GEMM1 would give), both with the exact float32 target logit, and measures
loss and gradient errors against float64 on the benchmark's inputs (bench_linear_cross_entropy.py:
normal and "peaky", every 7th target ignored), on fewer rows.
   python3 scripts/lce_logit_precision.py [--rows 256]
"""
import argparse

import torch

IGNORE = -100


def make_inputs(n, h, v, peaky, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, h, generator=g) * 0.02
    t = torch.randint(0, v, (n,), generator=g)
    x = torch.randn(n, h, generator=g) * 0.5
    if peaky:
        wt = w[t]
        x = 0.1 * x + 14.0 * wt / wt.square().sum(1, keepdim=True)
    t[::7] = IGNORE
    return x.bfloat16(), w.bfloat16(), t


def grads(logits, x, w, t, exact_zt, dz_dtype):
    """Mean loss, grad_x, grad_w from given logits (float32 or float64 math as the logits' dtype)."""
    valid = t != IGNORE
    tt = t.clamp_min(0)
    z = logits.clone()
    rows = torch.arange(len(t))
    if exact_zt is not None:
        z[rows, tt] = exact_zt.to(z.dtype)
    m = z.max(1).values
    log_sum = (z - m[:, None]).exp().sum(1).log()
    nll = (m - z[rows, tt]) + log_sum
    count = valid.sum()
    loss = (nll * valid).sum() / count
    p = (z - (m + log_sum)[:, None]).exp()
    p[rows, tt] = torch.expm1(-nll)  # p_t - 1 without cancellation, as the kernel
    dz = (p * valid[:, None] / count).to(dz_dtype)
    acc = torch.float64 if dz_dtype == torch.float64 else torch.float32
    gx = dz.to(acc) @ w.to(acc)
    gw = dz.to(acc).T @ x.to(acc)
    return loss, gx.to(dz_dtype), gw.to(dz_dtype)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    a = ap.parse_args()
    for peaky in (False, True):
        x, w, t = make_inputs(a.rows, a.hidden, a.vocab, peaky)
        ref = grads(x.double() @ w.double().T, x, w, t, None, torch.float64)
        z32 = x.float() @ w.float().T
        zt = (x.float() * w.float()[t.clamp_min(0)]).sum(1)
        print(f"{'peaky' if peaky else 'normal'} ({a.rows} x {a.hidden} x {a.vocab}, target prob "
              f"{torch.exp(-grads(z32, x, w, t, zt, torch.float32)[0]).item():.3f} at the mean loss):")
        for name, logits in (("float32 logits", z32), ("bf16 logits", z32.bfloat16().float())):
            loss, gx, gw = grads(logits, x, w, t, zt, torch.bfloat16)
            print(f"   {name:15s} loss rel err {abs(loss.item() - ref[0].item()) / abs(ref[0].item()):.2e}  "
                  f"grad_x {rel(gx, ref[1]):.2e}  grad_w {rel(gw, ref[2]):.2e}")


if __name__ == "__main__":
    main()
