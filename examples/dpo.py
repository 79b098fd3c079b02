"""Preference tuning with fuseforge's post-training losses: the small byte-level GPT of
examples/demo_model.py learns from examples/data/preferences.jsonl (40 hand-written pairs of a
helpful and a dismissive answer to a question) to prefer the helpful one.

Each pair becomes two byte sequences, "Q: <prompt>\\nA: <answer>"; the answer's tokens are the ones
scored. The policy's last hidden states and its output head go to the loss, so the (tokens x
vocabulary) logits never exist whole:

  --loss dpo (default), ipo, hinge: fuseforge.nn.PreferenceLoss, against a frozen reference copy of
        the starting policy (its log-probabilities computed once, with fuseforge.linear_logprobs);
  --loss simpo, cpo: fuseforge.nn.CPOLoss (no reference; cpo adds the chosen answers' NLL);
  --loss orpo: fuseforge.nn.ORPOLoss (the odds-ratio term plus the chosen answers' NLL);
  --loss kto: fuseforge.nn.KTOLoss on the answers as unpaired examples (chosen: desirable), its
        reference point from each prompt with another pair's answer (fuseforge.nn.kto_kl).
Each step's pairs run as --accumulate micro-batches whose gradients add up to the whole batch's
(num_items_in_batch, and num_chosen_tokens for the NLL term). The last --held-out pairs are not
trained on; their accuracy is the share of pairs whose chosen answer's log-probability rose more over
the starting policy's than the rejected one's. Prints progress and writes <loss>_curves.png (loss,
train and held-out accuracy) and <loss>.json under --out. On CUDA the model runs under bf16 autocast.

    python examples/dpo.py                      # CPU or GPU; well under a minute on 2 CPU cores
    python examples/dpo.py --loss orpo --steps 60 --out /tmp/orpo
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
from demo import param_groups  # noqa: E402
from demo_model import FuseforgeGPT, GPTConfig  # noqa: E402
from fuseforge import linear_logprobs  # noqa: E402
from fuseforge.nn import CPOLoss, KTOLoss, ORPOLoss, PreferenceLoss, kto_kl  # noqa: E402
from fuseforge.optim import AdamW  # noqa: E402
from grpo import autocast  # noqa: E402

LOSSES = ("dpo", "ipo", "hinge", "simpo", "cpo", "orpo", "kto")
DEFAULT_BETA = {"simpo": 2.0}  # the others: 0.1, TRL's default


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or auto (cuda when fuseforge has CUDA kernels and a GPU)")
    p.add_argument("--data", default=os.path.join(HERE, "data", "preferences.jsonl"),
                   help="JSON lines of {prompt, chosen, rejected}")
    p.add_argument("--out", default=os.path.join(HERE, "out"), help="folder for <loss>_curves.png and <loss>.json")
    p.add_argument("--loss", choices=LOSSES, default="dpo")
    p.add_argument("--beta", type=float, default=None, help="default: 2.0 for simpo, 0.1 for the others")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="pairs a step")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches a step")
    p.add_argument("--held-out", type=int, default=8, help="pairs left out of training, for the held-out accuracy")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and fuseforge.cuda_built() else "cpu"
    if args.beta is None:
        args.beta = DEFAULT_BETA.get(args.loss, 0.1)
    if args.batch % args.accumulate:
        p.error(f"--accumulate ({args.accumulate}) must divide --batch ({args.batch})")
    return args


def encode(prompts: list, answers: list, length: int):
    """(inputs, targets, mask), each (N, length - 1): the byte sequences "Q: <prompt>\\nA: <answer>"
    padded with zeros, shifted by one; mask marks the targets that are answer tokens."""
    inputs = torch.zeros(len(prompts), length - 1, dtype=torch.long)
    targets = torch.zeros_like(inputs)
    mask = torch.zeros_like(inputs)
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        prefix = f"Q: {prompt}\nA: ".encode()
        seq = torch.tensor(list(prefix + answer.encode()))
        inputs[i, :len(seq) - 1], targets[i, :len(seq) - 1] = seq[:-1], seq[1:]
        mask[i, len(prefix) - 1:len(seq) - 1] = 1
    return inputs, targets, mask


def sequence_logprobs(model, inputs, targets, mask) -> torch.Tensor:
    """(N,) the sums of the answer tokens' log-probabilities."""
    with autocast(inputs.device):
        hidden = model.embed(inputs)
    return (linear_logprobs(hidden, model.head.weight, targets) * mask).sum(-1)


def plot(curves: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax0.plot(range(1, len(curves["loss"]) + 1), curves["loss"], color="tab:orange", lw=1.4)
    ax0.set_title("loss (each step)", fontsize=9)
    ax0.set_xlabel("step")
    ax1.plot(range(1, len(curves["train_accuracy"]) + 1), curves["train_accuracy"], color="tab:orange", lw=1.0,
             alpha=0.6, label="train batch")
    steps, acc = zip(*curves["held_out_accuracy"])
    ax1.plot(steps, acc, "o-", color="tab:blue", label="held-out pairs")
    ax1.set_ylim(-0.05, 1.05)
    ax1.set_title("preference accuracy (chosen rose more than rejected)", fontsize=9)
    ax1.set_xlabel("step")
    ax1.legend(fontsize=8)
    for ax in (ax0, ax1):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    with open(args.data) as f:
        pairs = [json.loads(line) for line in f if line.strip()]
    if len(pairs) <= args.held_out:
        raise SystemExit(f"{len(pairs)} pairs in {args.data}: not more than --held-out {args.held_out}")
    prompts = [p["prompt"] for p in pairs]
    length = max(len(f"Q: {p['prompt']}\nA: {p[k]}".encode()) for p in pairs for k in ("chosen", "rejected"))
    chosen = [t.to(device) for t in encode(prompts, [p["chosen"] for p in pairs], length)]
    rejected = [t.to(device) for t in encode(prompts, [p["rejected"] for p in pairs], length)]
    # KTO's reference point: each prompt with the next pair's chosen answer (a mismatched completion).
    mismatched = [t.to(device) for t in encode(prompts, [p["chosen"] for p in pairs[1:] + pairs[:1]], length)]

    config = GPTConfig(vocab_size=256, block_size=length, n_layer=args.n_layer, n_head=args.n_head,
                       d_model=args.d_model)
    policy = FuseforgeGPT(config)
    policy.reset_parameters(args.seed)
    policy.to(device)
    reference = copy.deepcopy(policy).requires_grad_(False)  # the starting policy
    with torch.no_grad():
        ref_c, ref_r, ref_kl = (sequence_logprobs(reference, *batch) for batch in (chosen, rejected, mismatched))
    beta = args.beta
    loss_fn = {"dpo": lambda: PreferenceLoss("sigmoid", beta=beta), "ipo": lambda: PreferenceLoss("ipo", beta=beta),
               "hinge": lambda: PreferenceLoss("hinge", beta=beta),
               "simpo": lambda: CPOLoss("simpo", beta=beta, alpha=0.0), "cpo": lambda: CPOLoss("sigmoid", beta=beta),
               "orpo": lambda: ORPOLoss(beta=beta), "kto": lambda: KTOLoss(beta=beta)}[args.loss]()
    optimizer = AdamW(param_groups(policy, 0.0), lr=args.lr, betas=(0.9, 0.99))
    n_train = len(pairs) - args.held_out
    held_out = torch.arange(n_train, len(pairs), device=device)
    g = torch.Generator().manual_seed(args.seed)
    order = torch.cat([torch.randperm(n_train, generator=g) for _ in range(args.steps * args.batch // n_train + 1)])
    print(f"{args.loss} on {device}: GPT {config.n_layer} layers, d_model {config.d_model}, "
          f"{policy.num_parameters():,} parameters; {n_train} training pairs ({args.held_out} held out), "
          f"{args.steps} steps of {args.batch} pairs in {args.accumulate} micro-batches, beta {beta}, {loss_fn}",
          flush=True)

    def micro_loss(idx, pairs_in_batch, chosen_tokens):
        """The loss of the pairs idx, normalised by the whole step's counts."""
        ci, ct, cm = (t[idx] for t in chosen)
        ri, rt, rm = (t[idx] for t in rejected)
        with autocast(device):
            hidden = policy.embed(torch.cat([ci, ri]))  # one forward for both answers
        hc, hr = hidden[:len(idx)], hidden[len(idx):]
        head = policy.head.weight
        if args.loss == "kto":
            with torch.no_grad():
                kl = kto_kl(sequence_logprobs(policy, *(t[idx] for t in mismatched)), ref_kl[idx])
            desirable = torch.arange(2 * len(idx), device=device) < len(idx)
            return loss_fn(hidden, head, torch.cat([ct, rt]), torch.cat([cm, rm]), desirable,
                           torch.cat([ref_c[idx], ref_r[idx]]), kl=kl, num_items_in_batch=2 * pairs_in_batch)
        if isinstance(loss_fn, PreferenceLoss):
            rc, rr = ref_c[idx], ref_r[idx]
            if args.loss == "ipo":  # IPO compares mean log-probabilities
                rc, rr = rc / cm.sum(-1), rr / rm.sum(-1)
            return loss_fn(hc, hr, head, ct, rt, cm, rm, rc, rr, num_items_in_batch=pairs_in_batch)
        return loss_fn(hc, hr, head, ct, rt, cm, rm, num_items_in_batch=pairs_in_batch,
                       num_chosen_tokens=chosen_tokens)

    @torch.no_grad()
    def accuracy(idx) -> torch.Tensor:
        margin = ((sequence_logprobs(policy, *(t[idx] for t in chosen)) - ref_c[idx])
                  - (sequence_logprobs(policy, *(t[idx] for t in rejected)) - ref_r[idx]))
        return (margin > 0).float().mean()

    curves = {"loss": [], "train_accuracy": [], "held_out_accuracy": [(0, accuracy(held_out).item())]}
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = order[step * args.batch:(step + 1) * args.batch].to(device)
        chosen_tokens = chosen[2][batch].sum().item()
        total = 0.0
        for micro in batch.chunk(args.accumulate):
            loss = micro_loss(micro, len(batch), chosen_tokens)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        curves["loss"].append(total)
        curves["train_accuracy"].append(accuracy(batch).item())
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            curves["held_out_accuracy"].append((step + 1, accuracy(held_out).item()))
            print(f"  step {step + 1:4d}/{args.steps}  loss {total:.4f}  train accuracy "
                  f"{curves['train_accuracy'][-1]:.2f}  held-out accuracy {curves['held_out_accuracy'][-1][1]:.2f}  "
                  f"{time.perf_counter() - t0:5.1f} s", flush=True)

    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, f"{args.loss}_curves.png")
    try:
        plot(curves, png, f"{args.loss} (beta {beta}) of a {policy.num_parameters() / 1e6:.2f}M parameter byte-level "
                          f"GPT on {device.type}, {n_train} training pairs")
    except ImportError:
        png = None
        print("matplotlib is missing: no plot")
    summary = {"device": str(device), "args": vars(args), "curves": curves}
    with open(os.path.join(args.out, f"{args.loss}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"loss {curves['loss'][0]:.4f} -> {curves['loss'][-1]:.4f}, held-out accuracy "
          f"{curves['held_out_accuracy'][-1][1]:.2f}; wrote {png or '(no plot)'} and "
          f"{os.path.join(args.out, args.loss + '.json')}")
    return summary


if __name__ == "__main__":
    main()
