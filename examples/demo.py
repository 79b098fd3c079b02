"""fuseforge demo: the same small GPT trained twice on the text in examples/data, once written with
fuseforge ops (attention, add_mul_act, linear_cross_entropy, fuseforge.optim.AdamW) and once in
plain PyTorch (SDPA, F.gelu, nn.Linear + F.cross_entropy, torch.optim.AdamW), from the same initial
weights on the same batches, in lockstep (a step of each in turn, so both see the same machine).
Prints progress and a table (loss, tokens/s, a step's peak memory), and writes
loss_curves.png and summary.json under --out.

    python examples/demo.py                 # CPU: a small model, a few minutes; GPU: a larger one
    python examples/demo.py --steps 50 --d-model 64 --out /tmp/demo   # flags override the preset
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))  # run from a checkout without installing

import fuseforge  # noqa: E402  (loads the extension)
from demo_model import GPTConfig, make_pair  # noqa: E402
from fuseforge.optim import AdamW as FuseforgeAdamW  # noqa: E402

# Presets: the CPU one finishes in a few minutes on two cores; the GPU one fills an H100 better.
PRESETS = {
    "cpu": dict(d_model=128, n_layer=4, n_head=2, n_kv_head=1, seq_len=128, batch_size=8, steps=150,
                lr=2e-3, warmup=20, eval_every=50, amp=False),
    "gpu": dict(d_model=768, n_layer=8, n_head=12, n_kv_head=4, seq_len=1024, batch_size=16, steps=300,
                lr=1e-3, warmup=30, eval_every=50, amp=True),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when fuseforge has CUDA kernels and a GPU)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: gpu on cuda, cpu on cpu")
    p.add_argument("--data", default=os.path.join(HERE, "data"), help="folder of .txt files (byte-level tokens)")
    p.add_argument("--out", default=os.path.join(HERE, "out"), help="folder for loss_curves.png and summary.json")
    p.add_argument("--seed", type=int, default=0)
    for name, kind in [("d_model", int), ("n_layer", int), ("n_head", int), ("n_kv_head", int), ("seq_len", int),
                       ("batch_size", int), ("steps", int), ("lr", float), ("warmup", int), ("eval_every", int)]:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None, help="overrides the preset")
    p.add_argument("--amp", dest="amp", action="store_true", default=None, help="bf16 autocast (GPU preset default)")
    p.add_argument("--no-amp", dest="amp", action="store_false")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--sample-bytes", type=int, default=160, help="text to generate at the end (0: none)")
    p.add_argument("--only", choices=["fuseforge", "pytorch"], default=None, help="train one model only")
    p.add_argument("--state-dtype", choices=["float32", "bfloat16", "int8"], default="float32",
                   help="fuseforge AdamW's moment states (bfloat16 / int8: 4 / ~2 bytes a parameter instead of 8)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and fuseforge.cuda_built() else "cpu"
    preset = PRESETS[args.preset or ("gpu" if args.device == "cuda" else "cpu")]
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def load_bytes(folder: str) -> torch.Tensor:
    files = sorted(glob.glob(os.path.join(folder, "*.txt")))
    if not files:
        raise SystemExit(f"no .txt files in {folder}")
    data = b"\n\n".join(open(f, "rb").read() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Batches:
    """Random windows of the training bytes, the same sequence for every model (one seeded
    generator, offsets drawn once)."""

    def __init__(self, data: torch.Tensor, seq_len: int, batch_size: int, steps: int, seed: int):
        if data.numel() < seq_len + 2:
            raise SystemExit(f"{data.numel()} bytes of text is shorter than seq_len + 1 = {seq_len + 1}")
        g = torch.Generator().manual_seed(seed)
        self.data, self.seq_len = data, seq_len
        self.offsets = torch.randint(0, data.numel() - seq_len - 1, (steps, batch_size), generator=g)

    def __len__(self):
        return self.offsets.shape[0]

    def get(self, step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.offsets[step][:, None] + torch.arange(self.seq_len + 1)
        chunk = self.data[idx]
        return chunk[:, :-1].to(device, non_blocking=True), chunk[:, 1:].to(device, non_blocking=True)


def param_groups(model: torch.nn.Module, weight_decay: float):
    """Weight decay on matrices and embeddings, none on biases and LayerNorm weights."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class StepMemory:
    """Peak memory of a training step above what was in use before it (activations, grads and
    temporaries; weights and optimizer states are there before the step). CUDA:
    torch.cuda.max_memory_allocated(); CPU (Linux): the growth of the process's peak resident set
    (VmHWM, reset through /proc/self/clear_refs) after glibc has returned its free memory to the
    system (malloc_trim), so one model's freed memory does not hide the other's."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "step peak above allocated, CUDA" if device.type == "cuda" else "step peak RSS growth, CPU"
        self.base = None
        self._trim = None
        if device.type == "cpu":
            try:
                import ctypes
                self._trim = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):
                self._trim = None

    @staticmethod
    def _status_mib(key: str):
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(key):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
            return
        if self._trim is not None:
            self._trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = self._status_mib("VmRSS:")
        except OSError:
            self.base = None

    def peak_mib(self):
        if self.base is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / 2**20 - self.base
        peak = self._status_mib("VmHWM:")
        return None if peak is None else max(peak - self.base, 0.0)


@torch.no_grad()
def evaluate(model, val: torch.Tensor, args, device) -> float:
    """Mean loss on fixed consecutive windows of the held-out text."""
    model.eval()
    n = min(8, (val.numel() - 1) // args.seq_len)
    starts = torch.arange(n) * args.seq_len
    idx = starts[:, None] + torch.arange(args.seq_len + 1)
    chunk = val[idx].to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
        loss = model(chunk[:, :-1], chunk[:, 1:]).float().item()
    model.train()
    return loss


def train(runs: list, batches: Batches, val, args, device) -> list[dict]:
    """Trains the models in lockstep: every step runs each model's step in turn, on the same batch,
    so slow drifts of the machine's speed (clocks, other processes) fall on both alike. Each step is
    timed on its own (synchronized on CUDA); tokens/s leaves out the first steps (allocations,
    autotuning), whose second and third measure the step's peak memory."""
    mem = StepMemory(device)
    tokens_per_step = args.batch_size * args.seq_len
    warm_steps = min(3, len(batches) - 1)
    state = {name: {"losses": [], "val": [], "seconds": 0.0, "peak": None} for name, _, _ in runs}
    t_start = time.perf_counter()
    for step in range(len(batches)):
        x, y = batches.get(step, device)
        last = step == len(batches) - 1
        for name, model, optimizer in runs:
            st = state[name]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, args)
            probe = 1 <= step < max(2, warm_steps)  # memory on untimed steps (step 0 creates the optimizer states)
            if probe:
                mem.start()
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= warm_steps:
                st["seconds"] += time.perf_counter() - t0
            peak = mem.peak_mib() if probe else None
            if peak is not None:
                st["peak"] = max(st["peak"] or 0.0, peak)
            st["losses"].append(loss.detach().float())
            if (step + 1) % args.log_every == 0 or last:  # one host sync per log line, not per step
                recent = torch.stack(st["losses"][-args.log_every:]).mean().item()
                print(f"  {name:9s} step {step + 1:5d}/{len(batches)}  loss {recent:.4f}  "
                      f"lr {lr_at(step, args):.2e}  {time.perf_counter() - t_start:6.1f} s", flush=True)
            if val is not None and ((step + 1) % args.eval_every == 0 or last):
                st["val"].append((step + 1, evaluate(model, val, args, device)))
    results = []
    timed_steps = len(batches) - warm_steps
    for name, _, _ in runs:
        st = state[name]
        losses = torch.stack(st["losses"]).cpu().tolist()
        tail = losses[-max(1, len(losses) // 10):]
        results.append({"name": name, "losses": losses, "val": st["val"], "final_train_loss": sum(tail) / len(tail),
                        "final_val_loss": st["val"][-1][1] if st["val"] else None,
                        "tokens_per_s": timed_steps * tokens_per_step / max(st["seconds"], 1e-9),
                        "train_seconds": st["seconds"], "peak_mib": st["peak"], "peak_kind": mem.kind})
    return results


@torch.no_grad()
def sample(model, prompt: bytes, n: int, block_size: int, device, amp: bool, seed: int) -> str:
    """Top-k sampling from the model's logits (its forward without targets)."""
    g = torch.Generator(device=device).manual_seed(seed)
    model.eval()
    idx = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]
    for _ in range(n):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(idx[:, -block_size:])[:, -1].float()
        top = torch.topk(logits, 8)
        probs = torch.softmax(top.values / 0.8, -1)
        nxt = top.indices.gather(-1, torch.multinomial(probs, 1, generator=g))
        idx = torch.cat([idx, nxt], 1)
    model.train()
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


def plot(results: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"fuseforge": dict(color="tab:orange", lw=1.6), "pytorch": dict(color="tab:blue", lw=1.0, ls="--")}
    for r in results:
        steps = list(range(1, len(r["losses"]) + 1))
        ax.plot(steps, r["losses"], label=f"{r['name']} (train)", alpha=0.9, **styles[r["name"]])
        if r["val"]:
            vs, vl = zip(*r["val"])
            marker = dict(marker="o", ms=9, mfc="none", mew=1.6) if r["name"] == "fuseforge" else dict(marker="x", ms=6)
            ax.plot(vs, vl, ls="none", color=styles[r["name"]]["color"], label=f"{r['name']} (held-out)", **marker)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: list[dict]) -> str:
    head = f"{'model':10s} {'train loss':>10s} {'val loss':>9s} {'tokens/s':>11s} {'peak MiB':>9s}  ({results[0]['peak_kind']})"
    lines = [head, "-" * len(head)]
    for r in results:
        val = f"{r['final_val_loss']:.4f}" if r["final_val_loss"] is not None else "-"
        peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
        lines.append(f"{r['name']:10s} {r['final_train_loss']:10.4f} {val:>9s} {r['tokens_per_s']:11,.0f} {peak:>9s}")
    if len(results) == 2:
        ff, pt = results
        lines.append(f"fuseforge / pytorch: {ff['tokens_per_s'] / pt['tokens_per_s']:.2f}x tokens/s"
                     + (f", {ff['peak_mib'] / pt['peak_mib']:.2f}x peak memory" if ff["peak_mib"] and pt["peak_mib"] else "")
                     + f", |loss difference| at the end {abs(ff['final_train_loss'] - pt['final_train_loss']):.4f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    data = load_bytes(args.data)
    split = int(0.9 * data.numel())
    train_data, val_data = data[:split], data[split:]
    val = val_data if val_data.numel() > args.seq_len + 1 else None
    config = GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                       n_kv_head=args.n_kv_head, d_model=args.d_model)
    batches = Batches(train_data, args.seq_len, args.batch_size, args.steps, args.seed)
    ff_model, pt_model = make_pair(config, seed=args.seed, device=device)
    print(f"fuseforge demo on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else f'{torch.get_num_threads()} threads'}), "
          f"torch {torch.__version__}; {data.numel():,} bytes of text ({len(glob.glob(os.path.join(args.data, '*.txt')))} files)")
    print(f"GPT: {config.n_layer} layers, d_model {config.d_model}, {config.n_head} heads ({config.n_kv_head} kv), "
          f"seq {args.seq_len}, batch {args.batch_size}, {ff_model.num_parameters():,} parameters, {args.steps} steps, "
          f"{'bf16 autocast' if args.amp else 'float32'}", flush=True)

    hyper = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    runs = []
    if args.only in (None, "fuseforge"):
        runs.append(("fuseforge", ff_model, FuseforgeAdamW(param_groups(ff_model, 0.1), **hyper,
                                                           state_dtype=args.state_dtype)))
    if args.only in (None, "pytorch"):
        # torch's fastest AdamW on either device: its fused kernel (CUDA and CPU).
        runs.append(("pytorch", pt_model, torch.optim.AdamW(param_groups(pt_model, 0.1), **hyper, fused=True)))
    print(f"training {' and '.join(name for name, _, _ in runs)} in lockstep (one step of each in turn):", flush=True)
    results = train(runs, batches, val, args, device)

    print()
    print(table(results))
    os.makedirs(args.out, exist_ok=True)
    title = (f"byte-level GPT, {ff_model.num_parameters() / 1e6:.1f}M params, {args.steps} steps on {device.type}"
             f" ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'})")
    png = os.path.join(args.out, "loss_curves.png")
    try:
        plot(results, png, title)
    except ImportError:
        png = None
        print("matplotlib is missing: no plot")
    text = ""
    if args.sample_bytes > 0:
        models = {name: model for name, model, _ in runs}
        text = sample(models[results[0]["name"]], b"The ", args.sample_bytes, args.seq_len, device, args.amp, args.seed)
        print(f"\nsample from the {results[0]['name']} model:\n{text}\n")
    summary = {"device": str(device), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
               "torch": torch.__version__, "config": config.to_dict(),
               "train": {k: getattr(args, k) for k in ("seq_len", "batch_size", "steps", "lr", "warmup", "amp", "seed")},
               "data_bytes": data.numel(), "results": results, "sample": text}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {png or '(no plot)'} and {os.path.join(args.out, 'summary.json')}")
    return summary


if __name__ == "__main__":
    main()
