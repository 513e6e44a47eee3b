"""Today's published launch scripts train in one launch on 4 CPU ranks, every flag as the
script has it and only the sizes scaled down (model, batch, lengths; gloo instead of nccl):
Megatron-LM's Mixtral 8x7B and Llama-3 8B (FP8 example, its FP8 branch) and Megatron-DeepSpeed's
Llama 2 and GPT-3 125M (flash-attention, started by DeepSpeed's launcher) with their JSON.

Sources: NVIDIA/Megatron-LM examples/mixtral/train_mixtral_8x7b_distributed.sh and
examples/llama/train_llama3_8b_h100_fp8.sh; microsoft/Megatron-DeepSpeed
examples_deepspeed/pretrain_llama2_distributed.sh and
examples_deepspeed/rebase/ds_pretrain_gpt_125M_flashattn.sh with ds_config_gpt_TEMPLATE.json.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from megazero.config import load_config
from megazero.data.indexed_dataset import IndexedDatasetBuilder
from megazero.testing.launch import check, run_like_deepspeed, run_training

NPROC = 4


def _corpus(prefix: str, vocab: int, eod: int, docs: int = 400, length: int = 40) -> str:
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for _ in range(docs):
            b.add_document(np.append(rng.integers(3, vocab - 1, size=length), eod))
        b.finalize()
    return prefix


@pytest.fixture(scope="module")
def llama_tokenizer(tmp_path_factory):
    """A SentencePiece model with Llama 2's ids (unk 0, <s> 1, </s> 2)."""
    from megazero.data.demo import demo_files
    from megazero.data.tokenizers import train_sentencepiece

    d = tmp_path_factory.mktemp("tok")
    texts = [open(f, encoding="utf-8").read() for f in demo_files()[:3]]
    return train_sentencepiece(texts, str(d / "tokenizer"), 500)


def _trained(out: str, iterations: int) -> None:
    lines = [x for x in out.splitlines() if x.startswith(" iteration")]
    assert len(lines) == iterations and f"iteration {iterations:8d}/" in lines[-1], out[-3000:]


def test_megatron_lm_mixtral(tmp_path, llama_tokenizer):
    # --split 99990,8,2 as published: 12,500 documents leave one for validation
    data = _corpus(str(tmp_path / "corpus"), 500, 2, docs=12_500, length=8)
    ck = str(tmp_path / "ck")
    model = ["--use-mcore-models", "--disable-bias-linear", "--seq-length", "32",
             "--max-position-embeddings", "64", "--num-layers", "4", "--hidden-size", "32",
             "--ffn-hidden-size", "64", "--num-attention-heads", "4", "--init-method-std",
             "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization",
             "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
             "--untie-embeddings-and-output-weights", "--group-query-attention",
             "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
             "--rotary-base", "1000000"]
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
           "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm",
           "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather",
           "--overlap-grad-reduce"]
    data_args = ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", llama_tokenizer,
                 "--data-path", data, "--split", "99990,8,2"]
    training = ["--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-4",
                "--train-iters", "3", "--lr-decay-iters", "2", "--lr-decay-style", "cosine",
                "--min-lr", "1.0e-5", "--weight-decay", "0.1", "--lr-warmup-iters", "1",
                "--clip-grad", "1.0", "--bf16"]
    parallel = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                "--sequence-parallel"]
    logging = ["--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
               "--eval-iters", "2", "--save", ck, "--load", ck, "--tensorboard-dir",
               f"{ck}/tensorboard", "--no-load-optim", "--no-load-rng",
               "--wandb-project", "Mixtral", "--wandb-exp-name", "Mixtral_8x7B"]
    out = check(run_training([*model, *moe, *data_args, *training, *parallel, *logging,
                              "--distributed-backend", "gloo"], nproc=NPROC, timeout=400))
    _trained(out, 3)
    assert "> tokenizer" not in out and "Llama2Tokenizer" in out
    assert "> moe: 4 experts, top-2 (aux_loss), expert parallel 2, alltoall" in out
    assert "validation loss at iteration 3" in out


LLAMA3 = {
    "model": ["--use-mcore-models", "--num-layers", "4", "--hidden-size", "32",
              "--ffn-hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
              "--num-query-groups", "2", "--kv-channels", "8", "--seq-length", "32",
              "--max-position-embeddings", "32", "--position-embedding-type", "rope",
              "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout",
              "0.0", "--hidden-dropout", "0.0", "--swiglu", "--normalization", "RMSNorm",
              "--init-method-std", "0.0134", "--attention-backend", "fused",
              "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
              "--disable-bias-linear"],
    "training": ["--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "24",
                 "--lr-decay-samples", "16", "--lr-warmup-samples", "8", "--lr", "0.00015",
                 "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr",
                 "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
                 "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                 "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
                 "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level",
                 "1", "--exit-duration-in-mins", "235", "--use-distributed-optimizer",
                 "--overlap-grad-reduce", "--overlap-param-gather"],
    # the script's DTYPE=fp8 branch ("--fp8-format hybrid" ... as one word each, split by the
    # shell when the array is expanded unquoted)
    "fp8": ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
            "--fp8-amax-compute-algo", "max", "--fp8-param-gather"],
    "parallel": ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
                 "--sequence-parallel"],
    # the MOCK branch; "--split '99,1,0'" keeps its quotes through the unquoted expansion
    "data": ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
             "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
             "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
             "--num-workers", "1"],
}


def test_megatron_lm_llama3_8b(tmp_path):
    ck, cache = str(tmp_path / "ck"), str(tmp_path / "cache")
    logging = ["--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100",
               "--save-interval", "1000", "--log-throughput", "--profile",
               "--profile-step-start", "2", "--profile-step-end", "3", "--ckpt-format",
               "torch_dist", "--distributed-timeout-minutes", "60", "--save", ck, "--load", ck,
               "--tensorboard-dir", str(tmp_path / "tb")]
    args = [*LLAMA3["model"], *LLAMA3["training"], *LLAMA3["parallel"], *LLAMA3["data"],
            "--data-cache-path", cache, *logging, "--distributed-backend", "gloo"]
    # the script's FP8 branch: delayed scaling, and FP8 parameter gathers with the
    # distributed optimizer (ZeRO-1) over dp 4
    pr = load_config([*args, *LLAMA3["fp8"]], NPROC).precision
    assert (pr.fp8_format, pr.fp8_recipe, pr.fp8_amax_history_len, pr.fp8_amax_compute_algo,
            pr.fp8_param_gather) == ("hybrid", "delayed", 1024, "max", True)
    out = check(run_training([*args, *LLAMA3["fp8"]], nproc=NPROC, timeout=400))
    _trained(out, 3)
    assert "embedding and output layer from 0.0005 to 4.5e-05" in out
    assert "note: --profile without --use-pytorch-profiler" in out
    assert "> fp8: hybrid format, delayed" in out
    assert "> --fp8-param-gather: 16 FP8 GEMM weights" in out  # 4 layers x QKV, proj, fc1, fc2


def test_megatron_deepspeed_llama2(tmp_path, llama_tokenizer):
    ds = tmp_path / "deepspeed.json"
    ds.write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                              "steps_per_print": 1, "zero_optimization": {"stage": 0},
                              "bf16": {"enabled": True}}))
    data = _corpus(str(tmp_path / "bookcorpus_train_1m_text_sentence"), 500, 2)
    ck = str(tmp_path / "ck")
    ds_args = ["--deepspeed-activation-checkpointing", "--recompute-granularity", "full",
               "--recompute-method", "uniform", "--zero-stage=0", f"--deepspeed_config={ds}",
               "--deepspeed"]
    args = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64",
            "--num-attention-heads", "4", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--train-iters", "3",
            "--save", ck, "--load", ck, "--data-path", "1", data, "--data-impl", "mmap",
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
            llama_tokenizer, "--split", "949,50,1", "--distributed-backend", "gloo", "--lr",
            "3e-4", "--lr-decay-style", "cosine", "--min-lr", "3e-5", "--weight-decay", "0.1",
            "--clip-grad", "1", "--lr-warmup-iters", "1", "--optimizer", "adam",
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--log-interval", "1",
            "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "1", "--bf16",
            "--no-query-key-layer-scaling", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights",
            "--swiglu", "--normalization", "rmsnorm", "--disable-bias-linear",
            "--num-key-value-heads", "2", *ds_args]
    out = check(run_training(args, nproc=NPROC, timeout=400))
    _trained(out, 3)
    assert "RMSNorm, RoPE, SwiGLU MLP 64, 2 query groups" in out


def test_megatron_deepspeed_gpt_125m_with_deepspeeds_launcher(tmp_path):
    from megazero.testing.hf_models import write_bpe_files

    vocab, merges, size = write_bpe_files(str(tmp_path))
    data = _corpus(str(tmp_path / "my-gpt2_text_document"), size, size - 1)
    ck, tb = str(tmp_path / "checkpoint"), str(tmp_path / "tensorboard")
    # ds_config_gpt_TEMPLATE.json with GBSIZE 4, MBSIZE 2, LOG_INTERVAL 1, ZERO_STAGE 1
    config = tmp_path / "ds_config_gbs4_mbs2_log1_zero1.json"
    config.write_text(json.dumps({
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
        "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                 "min_loss_scale": 1, "initial_scale_power": 11},
        "wall_clock_breakdown": False}))
    # 4 x 32 = 128 tokens per iteration: 384 tokens are 3 iterations, --train-samples twice that
    megatron_options = [
        "--no-gradient-accumulation-fusion", "--override-opt_param-scheduler", "--adam-beta1",
        "0.9", "--adam-beta2", "0.95", "--tensor-model-parallel-size", "2", "--init-method-std",
        "0.02", "--lr-decay-tokens", "384", "--lr-warmup-tokens", "128", "--micro-batch-size",
        "2", "--exit-duration-in-mins", "30000000", "--global-batch-size", "4", "--num-layers",
        "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--train-tokens", "384", "--train-samples", "24",
        "--lr", "6.0e-4", "--min-lr", "1.0e-6", "--lr-decay-style", "cosine", "--split",
        "949,50,1", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
        "--save-interval", "1000", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--hysteresis", "2", "--num-workers", "0", "--fp16", "--seed", "1234", "--load", ck,
        "--save", ck, "--no-async-tensor-model-parallel-allreduce", "--use-flash-attn",
        "--tensorboard-queue-size", "1", "--log-timers-to-tensorboard",
        "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--tensorboard-dir", tb, "--checkpoint-activations",
        "--log-optimizer-states-to-tensorboard"]
    data_options = ["--vocab-file", vocab, "--merge-file", merges, "--data-path", data,
                    "--data-impl", "mmap"]
    deepspeed_options = ["--deepspeed", "--deepspeed_config", str(config), "--zero-stage", "1",
                         "--pipeline-model-parallel-size", "2",
                         "--deepspeed-activation-checkpointing"]
    out = check(run_like_deepspeed([*megatron_options, *data_options, *deepspeed_options,
                                    "--distributed-backend", "gloo"], NPROC, timeout=400))
    _trained(out, 3)
    assert "reached --train-tokens 384 at iteration 3 (384 tokens)" in out
    assert "warm-up 128 tokens, decay over 384 tokens" in out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"batch-size vs samples", "lm loss validation ppl vs samples",
            "optimizer/variance_l2", "time/forward_ms"} <= tags, tags
