"""GRPO with fuseforge.nn.GRPOLoss: the small byte-level GPT of examples/demo_model.py learns, from a
reward alone, to continue snippets of the text in examples/data with lowercase letters and spaces.

Each step samples a group of completions for each prompt from the current policy (the completions
are plain tensors: ids and a mask that ends each at its first "."), scores them (the fraction of
lowercase letters and spaces up to the "."), normalises the rewards within each group into
advantages, takes the sampling policy's and a frozen reference copy's log-probabilities with
fuseforge.linear_logprobs under no_grad, and runs --updates optimizer steps of GRPOLoss on the
completions (the clipped surrogate with the k3 KL to the reference, TRL's definitions) from the
policy's last hidden states and its output head: the (tokens x vocabulary) logits never exist whole.
On CUDA the model runs under bf16 autocast.
Prints progress and writes grpo_curves.png (loss, mean reward, KL to the reference a step) and
grpo.json under --out.

    python examples/grpo.py                              # CPU or GPU; about a minute on 2 CPU cores
    python examples/grpo.py --steps 80 --group 16 --out /tmp/grpo
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))  # run from a checkout without installing

import fuseforge  # noqa: E402  (loads the extension)
from demo import load_bytes, param_groups  # noqa: E402
from demo_model import FuseforgeGPT, GPTConfig  # noqa: E402
from fuseforge import linear_logprobs  # noqa: E402
from fuseforge.nn import GRPOLoss  # noqa: E402
from fuseforge.optim import AdamW  # noqa: E402

STOP = ord(".")


def autocast(device: torch.device):
    """bf16 autocast on CUDA, where fuseforge's attention takes float16 or bfloat16; off on the CPU. The
    final LayerNorm's output (the hidden states the losses take) stays float32 either way."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or auto (cuda when fuseforge has CUDA kernels and a GPU)")
    p.add_argument("--data", default=os.path.join(HERE, "data"), help="folder of .txt files: the prompts' text")
    p.add_argument("--out", default=os.path.join(HERE, "out"), help="folder for grpo_curves.png and grpo.json")
    p.add_argument("--steps", type=int, default=25, help="generations (each followed by --updates optimizer steps)")
    p.add_argument("--prompts", type=int, default=8, help="prompts a generation")
    p.add_argument("--group", type=int, default=8, help="completions a prompt (GRPO's group)")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--completion-len", type=int, default=16)
    p.add_argument("--updates", type=int, default=2, help="optimizer steps on each generation (TRL's num_iterations)")
    p.add_argument("--loss-type", choices=["grpo", "bnpo", "dr_grpo"], default="bnpo")
    p.add_argument("--beta", type=float, default=0.04, help="weight of the KL to the reference model")
    p.add_argument("--epsilon", type=float, default=0.2, help="the ratio's clip range")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and fuseforge.cuda_built() else "cpu"
    return args


def reward(completions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The fraction of lowercase letters and spaces among each completion's tokens (up to its ".")."""
    good = ((completions >= ord("a")) & (completions <= ord("z"))) | (completions == ord(" "))
    return (good & mask.bool()).sum(-1) / mask.sum(-1).clamp(min=1)


@torch.no_grad()
def generate(model, prompts: torch.Tensor, length: int, generator: torch.Generator):
    """Samples `length` tokens after each prompt (temperature 1); returns the completions (B, length)
    and their mask: 1 up to and including the first ".", 0 after it."""
    idx = prompts
    for _ in range(length):
        with autocast(idx.device):
            logits = model(idx)[:, -1].float()
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        idx = torch.cat([idx, nxt], 1)
    completions = idx[:, prompts.shape[1]:]
    stopped_before = torch.cumsum((completions == STOP).long(), 1) - (completions == STOP).long()
    return completions, (stopped_before == 0).long()


def completion_hidden(model, prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    """The last hidden states that predict each completion token: positions P-1 .. P+L-2."""
    seq = torch.cat([prompts, completions], 1)
    with autocast(seq.device):
        hidden = model.embed(seq[:, :-1])
    return hidden[:, prompts.shape[1] - 1:]


def plot(curves: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, label in zip(axes, ("loss", "reward", "kl"),
                              ("GRPO loss (each update)", "mean reward (each generation)", "KL to the reference (k3)")):
        ys = curves[key]
        ax.plot(range(1, len(ys) + 1), ys, color="tab:orange", lw=1.4)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("update" if key == "loss" else "generation")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    text = load_bytes(args.data)
    config = GPTConfig(vocab_size=256, block_size=args.prompt_len + args.completion_len, n_layer=args.n_layer,
                       n_head=args.n_head, d_model=args.d_model)
    policy = FuseforgeGPT(config)
    policy.reset_parameters(args.seed)
    policy.to(device)
    reference = copy.deepcopy(policy).requires_grad_(False)  # the policy before training
    optimizer = AdamW(param_groups(policy, 0.0), lr=args.lr, betas=(0.9, 0.99))
    loss_fn = GRPOLoss(beta=args.beta, epsilon_low=args.epsilon, loss_type=args.loss_type,
                       max_completion_length=args.completion_len)
    g = torch.Generator().manual_seed(args.seed)
    g_sample = torch.Generator(device=device).manual_seed(args.seed)
    print(f"GRPO on {device}: GPT {config.n_layer} layers, d_model {config.d_model}, "
          f"{policy.num_parameters():,} parameters; {args.steps} generations of {args.prompts} prompts x "
          f"{args.group} completions of {args.completion_len} bytes, {args.updates} updates each, "
          f"loss_type {args.loss_type}, beta {args.beta}", flush=True)

    curves = {"loss": [], "reward": [], "kl": []}
    t0 = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, text.numel() - args.prompt_len, (args.prompts,), generator=g)
        prompts = text[starts[:, None] + torch.arange(args.prompt_len)].repeat_interleave(args.group, 0).to(device)
        completions, mask = generate(policy, prompts, args.completion_len, g_sample)
        rewards = reward(completions, mask).float()
        grouped = rewards.view(args.prompts, args.group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
        head = policy.head.weight
        with torch.no_grad():  # the sampling policy's and the reference's log-probabilities, once a generation
            old = linear_logprobs(completion_hidden(policy, prompts, completions), head, completions)
            ref = linear_logprobs(completion_hidden(reference, prompts, completions), reference.head.weight,
                                  completions)
        for _ in range(args.updates):
            hidden = completion_hidden(policy, prompts, completions)
            loss = loss_fn(hidden, head, completions, mask, advantages, old_logprobs=old, ref_logprobs=ref)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            curves["loss"].append(loss.item())
        delta = ref - old
        kl = ((torch.exp(delta) - delta - 1) * mask).sum() / mask.sum()
        curves["reward"].append(rewards.mean().item())
        curves["kl"].append(kl.item())
        if step % 5 == 0 or step == args.steps - 1:
            sample = bytes(completions[0].tolist()).decode("utf-8", errors="replace").replace("\n", " ")
            print(f"  step {step + 1:4d}/{args.steps}  loss {curves['loss'][-1]:+.4f}  reward "
                  f"{curves['reward'][-1]:.3f}  kl {curves['kl'][-1]:.4f}  {time.perf_counter() - t0:5.1f} s  "
                  f"{sample!r}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "grpo_curves.png")
    try:
        plot(curves, png, f"GRPO ({args.loss_type}, beta {args.beta}) of a {policy.num_parameters() / 1e6:.2f}M "
                          f"parameter byte-level GPT on {device.type}: reward = lowercase letters and spaces")
    except ImportError:
        png = None
        print("matplotlib is missing: no plot")
    summary = {"device": str(device), "args": vars(args), "curves": curves}
    with open(os.path.join(args.out, "grpo.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"mean reward {curves['reward'][0]:.3f} -> {curves['reward'][-1]:.3f}; wrote {png or '(no plot)'} and "
          f"{os.path.join(args.out, 'grpo.json')}")
    return summary


if __name__ == "__main__":
    main()
