"""The demo's small GPT (examples/demo_model.py) trained data-parallel under torchrun: FSDP2
(fully_shard each block, then the root) or DDP; gloo on the CPU, nccl on GPUs (one per rank).

    torchrun --nproc_per_node=2 examples/train_distributed.py                   # FSDP2, fuseforge
    torchrun --nproc_per_node=2 examples/train_distributed.py --impl pytorch    # the same in plain torch
    torchrun --nproc_per_node=2 examples/train_distributed.py --dp ddp --steps 50
    torchrun --nproc_per_node=8 examples/train_distributed.py --bf16            # GPUs: bf16 MixedPrecisionPolicy

--impl fuseforge: fuseforge attention, add_mul_act and linear_cross_entropy, fuseforge.optim.AdamW
(one launch per step updates every local shard); --impl pytorch: SDPA, F.gelu, nn.Linear +
F.cross_entropy, torch.optim.AdamW. Each rank reads its own batches (the data of examples/data, as
examples/demo.py reads it) and prints its tokens/s; rank 0 prints the mean loss over ranks.
--save DIR writes a torch.distributed.checkpoint of model and optimizer at the end, --load DIR
resumes from one.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))  # run from a checkout without installing
sys.path.insert(0, HERE)

import fuseforge  # noqa: E402  (loads the extension)
from demo_model import FuseforgeGPT, GPTConfig, TorchGPT  # noqa: E402
from fuseforge.optim import AdamW as FuseforgeAdamW  # noqa: E402
from demo import Batches, load_bytes, lr_at, param_groups  # noqa: E402

PRESETS = {
    "cpu": dict(d_model=128, n_layer=4, n_head=2, n_kv_head=1, seq_len=128, batch_size=4, steps=300, lr=2e-3,
                warmup=10),
    "gpu": dict(d_model=768, n_layer=8, n_head=12, n_kv_head=4, seq_len=1024, batch_size=8, steps=200, lr=1e-3,
                warmup=20),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=["fuseforge", "pytorch"], default="fuseforge")
    p.add_argument("--dp", choices=["fsdp", "ddp"], default="fsdp", help="FSDP2 (fully_shard) or DDP")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda (nccl) when fuseforge has CUDA kernels and there is a GPU per rank, else cpu (gloo)")
    p.add_argument("--data", default=os.path.join(HERE, "data"), help="folder of .txt files (byte-level tokens)")
    p.add_argument("--seed", type=int, default=0)
    for name, kind in [("d_model", int), ("n_layer", int), ("n_head", int), ("n_kv_head", int), ("seq_len", int),
                       ("batch_size", int), ("steps", int), ("lr", float), ("warmup", int)]:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                       help="overrides the preset (batch size is per rank)")
    p.add_argument("--bf16", action="store_true",
                   help="GPU: FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) / DDP: bf16 autocast")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save", default=None, help="write a DCP checkpoint (model + optimizer) here at the end")
    p.add_argument("--load", default=None, help="resume from a DCP checkpoint written by --save")
    args = p.parse_args(argv)
    return args


def setup(args) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "auto":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        args.device = "cuda" if fuseforge.cuda_built() and n >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")) else "cpu"
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        dist.init_process_group("gloo")
    for k, v in PRESETS["gpu" if device.type == "cuda" else "cpu"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.bf16 and device.type != "cuda":
        raise SystemExit("--bf16 is for GPUs (fuseforge's CPU kernels run float32)")
    return device


def build(args, device):
    config = GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                       n_kv_head=args.n_kv_head, d_model=args.d_model)
    model = (FuseforgeGPT if args.impl == "fuseforge" else TorchGPT)(config)
    model.reset_parameters(args.seed)  # the same weights on every rank
    model.to(device)
    if args.dp == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
        kw = {"mp_policy": mp} if mp else {}
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)  # the root: embeddings, final norm, tied head (used inside its forward)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    groups = param_groups(model, 0.1)
    if args.impl == "fuseforge":
        opt = FuseforgeAdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    else:
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    return model, opt


def main(argv=None) -> None:
    args = parse_args(argv)
    device = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_bytes(args.data)
    train = data[: int(0.9 * data.numel())]
    batches = Batches(train, args.seq_len, args.batch_size, args.steps, seed=args.seed + 1000 * rank)
    model, opt = build(args, device)
    if args.load:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=args.load)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    nparams = sum(p.numel() for p in model.parameters())  # FSDP: the global sizes of the DTensors
    if rank == 0:
        print(f"{args.impl} GPT, {args.dp} on {world} x {device.type} ({dist.get_backend()}), {nparams / 1e6:.2f}M "
              f"parameters, {args.steps} steps of {args.batch_size} x {args.seq_len} tokens per rank", flush=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16 and args.dp == "ddp")
    tokens = args.batch_size * args.seq_len
    losses = []
    warm = min(2, args.steps - 1)  # the first steps (allocations, lazy init) are left out of tokens/s
    t0 = t_warm = time.perf_counter()
    for step in range(args.steps):
        if step == warm:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_warm = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        x, y = batches.get(step, device)
        with autocast:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
        if (step + 1) % args.log_every == 0 or step == args.steps - 1:
            mean = torch.stack(losses[-args.log_every:]).mean()
            dist.all_reduce(mean, op=dist.ReduceOp.SUM)
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            timed = step + 1 - warm
            tps = timed * tokens / (now - t_warm) if step >= warm and now > t_warm else float("nan")
            line = f"rank {rank} step {step + 1:5d}/{args.steps}  {tps:10.0f} tokens/s" + \
                (f"  loss {mean.item() / world:.4f}" if rank == 0 else "")
            sys.stdout.write(line + "\n")  # one write per line: ranks share the terminal
            sys.stdout.flush()
    if args.save:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.save)
    if rank == 0:
        print(f"done in {time.perf_counter() - t0:.1f} s", flush=True)
    dist.barrier()
    # gloo's worker thread drops its reference to a collective's tensors after the collective
    # returns, and that needs the GIL: if the interpreter starts shutting down first, the thread
    # exits mid-destructor and the process aborts ("terminate called without an active exception",
    # torch 2.14 on CPU: 6 of 60 runs of this script). Releasing the GIL for a moment lets it finish.
    time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
