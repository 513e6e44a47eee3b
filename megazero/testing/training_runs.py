"""Training runs inside a spawned world, for checkpoint tests (setup + train, as
``pretrain_gpt.py`` does, but with an injectable checkpoint writer)."""

from __future__ import annotations

import os

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "3e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1000",
        "--eval-interval", "1000", "--eval-iters", "0", "--seed", "7",
        # A fixed decay length: runs that resume with a larger --train-iters keep the schedule
        # (a changed schedule is refused on resume, as in Megatron).
        "--lr-decay-iters", "100"]


def train_in_rank(rank: int, world: int, args: list[str], writer=None, keep_run=False):
    """Set up and train one run on this rank; returns ``{iteration: loss}`` (and the run)."""
    from megazero.config import load_config
    from megazero.training.lifecycle import setup
    from megazero.training.loop import train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    cfg = load_config(args, world)
    run = setup(cfg)
    run.checkpoint_writer = writer
    try:
        state = train(run)
    finally:
        run.close()
    losses = {int(h["iteration"]): h["loss"] for h in state.history}
    return (losses, run) if keep_run else losses
