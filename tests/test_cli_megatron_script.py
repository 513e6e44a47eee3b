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


def _corpus(tmp_path) -> tuple[str, str, str]:
    """A GPT-2 BPE vocabulary and a corpus tokenized with it: (data prefix, vocab, merges)."""
    import numpy as np

    from megazero.data.indexed_dataset import IndexedDatasetBuilder
    from megazero.testing.hf_models import write_bpe_files

    vocab, merges, size = write_bpe_files(str(tmp_path))
    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "corpus_text_document")
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for _ in range(400):
            b.add_document(np.append(rng.integers(0, size - 1, size=20), size - 1))
        b.finalize()
    return prefix, vocab, merges


def test_megatron_gpt3_175b_script_runs_in_one_launch(tmp_path):
    """examples/gpt3/train_gpt3_175b_distributed.sh, every flag as the script has it (the
    ramp-up, Megatron's default GPT-2 tokenizer from --vocab-file/--merge-file, --save equal to
    --load, TensorBoard), with the sizes scaled to a tiny model and the flags commonly added."""
    prefix, vocab, merges = _corpus(tmp_path)
    ck, tb = str(tmp_path / "ck"), str(tmp_path / "tb")
    script = [
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "4",
        "--rampup-batch-size", "1", "1", "6", "--train-iters", "4",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
        "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
        "--lr-decay-iters", "4",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--data-path", prefix, "--vocab-file", vocab, "--merge-file", merges,
        "--split", "949,50,1",
        "--log-interval", "1", "--save-interval", "2", "--eval-interval", "1000",
        "--save", ck, "--load", ck, "--eval-iters", "1", "--tensorboard-dir", tb,
        # added by most users of the script
        "--use-mcore-models", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--overlap-param-gather", "--cross-entropy-loss-fusion", "--eod-mask-loss",
        "--ckpt-format", "torch_dist", "--manual-gc", "--manual-gc-interval", "2",
        "--log-num-zeros-in-grad", "--log-throughput", "--distributed-backend", "gloo",
    ]
    out = check(run_training(script, nproc=4, timeout=300))
    assert "> tokenizer: GPT2BPETokenizer (Megatron's default" in out
    assert "iteration        4/       4" in out
    sizes = [int(line.split("global batch size:")[1].split("|")[0]) for line in out.splitlines()
             if line.startswith(" iteration")]
    assert sizes == [1, 1, 2, 3], sizes  # 3 steps of one over 6 samples: one every 2 samples
    assert "num zeros:" in out and "ZeRO stage 1" in out
