"""A Megatron-LM user's GPT-3 launch script (the flags of Megatron's examples/gpt3 pretraining
script and the ones commonly added to it) runs unchanged apart from the sizes."""

from __future__ import annotations

from megazero.config import load_config
from megazero.testing.launch import check, run_training

# Megatron's examples/gpt3 flag set; only the sizes are shrunk, --mock-data replaces the corpus.
MEGATRON_GPT3 = [
    "--use-mcore-models", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3",
    "--lr", "6.0e-5", "--lr-decay-iters", "3", "--lr-decay-style", "cosine", "--min-lr",
    "6.0e-6", "--weight-decay", "0.1", "--lr-warmup-fraction", ".34", "--adam-beta1", "0.9",
    "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16",
    "--attention-dropout", "0.1", "--hidden-dropout", "0.1", "--kv-channels", "8",
    "--attention-softmax-in-fp32", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion", "--use-flash-attn",
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--split", "949,50,1", "--log-interval", "1", "--log-throughput",
    "--tensorboard-log-interval", "1", "--save-interval", "1000", "--eval-interval", "1000",
    "--eval-iters", "1", "--num-workers", "2", "--exit-signal-handler",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
]


def test_megatron_flags_mean_what_they_mean_in_megatron():
    cfg = load_config(MEGATRON_GPT3, world_size=4)
    o = cfg.optimizer
    assert (o.lr_warmup_iters, o.lr_decay_iters, o.lr_decay_style) == (1, 3, "cosine")
    assert (o.adam_beta2, o.min_lr, cfg.precision.fp16) == (0.95, 6.0e-6, True)
    cfg = load_config(["--mock-data", "--global-batch-size", "4", "--train-iters", "10",
                       "--lr-warmup-samples", "8", "--lr-decay-samples", "20"], world_size=1)
    assert (cfg.optimizer.lr_warmup_iters, cfg.optimizer.lr_decay_iters) == (2, 5)


def test_megatron_gpt3_script_runs_unchanged():
    # the CPU suite picks gloo explicitly (on a GPU machine the default is nccl)
    out = check(run_training([*MEGATRON_GPT3, "--distributed-backend", "gloo"], nproc=4,
                             timeout=240))
    assert "iteration        3/       3" in out
