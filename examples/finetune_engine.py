"""Fine-tune a small causal language model on a local text file with megazero's engine, in the
shape of a DeepSpeed training loop (only the import differs)::

    torchrun --nproc_per_node 2 examples/finetune_engine.py \\
        --deepspeed_config examples/ds_config_zero2.json --text FILE [--save-dir DIR]

The text is read as bytes (a 256-token byte-level vocabulary: nothing to download); the model
is a tiny GPT-2 built from a ``transformers`` config. With ``--save-dir`` the run saves every
``--save-every`` steps and resumes from the newest checkpoint there when restarted.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist

import megazero


def byte_windows(path: str, seq_len: int) -> torch.Tensor:
    """Overlapping windows of ``seq_len`` bytes (stride seq_len / 4): the training samples."""
    data = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8).long()
    if data.numel() <= seq_len:
        raise SystemExit(f"{path}: {data.numel()} bytes; need more than --seq-len {seq_len}")
    stride = max(1, seq_len // 4)
    starts = range(0, data.numel() - seq_len + 1, stride)
    return torch.stack([data[s:s + seq_len] for s in starts])


def build_model(seq_len: int) -> torch.nn.Module:
    try:
        import transformers
    except ImportError:
        raise SystemExit("finetune_engine.py needs transformers: pip install -e '.[hf]'") from None

    config = transformers.GPT2Config(vocab_size=256, n_positions=seq_len, n_embd=64, n_layer=2,
                                     n_head=4, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON config")
    p.add_argument("--text", required=True, help="a local text file to train on")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps to run")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--save-dir", default=None, help="checkpoint directory (resumed from)")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--backend", default=None, help="torch.distributed backend (default: nccl "
                   "with GPUs, else gloo)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = p.parse_args()

    megazero.init_distributed(args.backend)
    samples = byte_windows(args.text, args.seq_len)
    model = build_model(args.seq_len)
    engine, _, loader, _ = megazero.initialize(args=args, model=model,
                                               model_parameters=model.parameters(),
                                               training_data=samples)
    epoch = 0
    if args.save_dir:
        path, client_state = engine.load_checkpoint(args.save_dir)
        if path is not None:
            epoch = client_state["epoch"]
            if engine.global_rank == 0:
                print(f"resumed from {path} at step {engine.global_steps}", flush=True)
    while engine.global_steps < args.steps:
        loader.sampler.set_epoch(epoch)
        step_loss = torch.zeros((), device=engine.device)
        for batch in loader:
            batch = batch.to(engine.device)
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            step_loss += loss.detach().float()
            engine.step()
            boundary = engine.micro_steps % engine.gradient_accumulation_steps() == 0
            if boundary:
                # the step's loss: its micro-batches' mean, averaged over the ranks
                step_loss /= engine.gradient_accumulation_steps()
                if dist.is_initialized():
                    dist.all_reduce(step_loss)
                    step_loss /= dist.get_world_size()
                if engine.was_step_applied() and engine.global_rank == 0:
                    print(f"step {engine.global_steps} loss {step_loss.item():.4f} "
                          f"(perplexity {math.exp(step_loss.item()):.1f})", flush=True)
                step_loss.zero_()
            if boundary and args.save_dir and engine.global_steps % args.save_every == 0:
                engine.save_checkpoint(args.save_dir, tag=f"step{engine.global_steps}",
                                       client_state={"epoch": epoch})
            if engine.global_steps >= args.steps:
                break
        epoch += 1


if __name__ == "__main__":
    main()
