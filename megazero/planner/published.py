"""Published runs the step-time model is checked against: Megatron-LM's 2021 Table 1.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC21, arXiv 2104.04473), Table 1: GPT models of 1.7B to 1T parameters, sequence
2048, vocabulary 51200, on 32 to 3072 A100 80GB GPUs (DGX A100 nodes, 8 x 200 Gb/s HDR
InfiniBand each), fp16, full activation recompute of every layer. The table gives the
achieved TFLOP/s per GPU, counted with the paper's formula (its equation 3, recompute
included)::

    F = 96 B s l h^2 (1 + s / (6h) + V / (16 l h))   per iteration

so the published iteration time is ``F / (GPUs x TFLOP/s)``. The settings of each row that
the table leaves out (micro-batch size, layers per virtual stage, torch DDP overlapping the
gradient all-reduce with backward in the first four rows, Megatron's own non-overlapped DDP
in the others) are those of the paper's released launch script, examples/sc21/run_table_1.sh
in NVIDIA/Megatron-LM. The runs used the scatter/gather optimisation for pipeline sends
between nodes and the unfused attention core (its ``s x s`` scores go through memory).

:func:`predict` times a row with :func:`megazero.planner.estimate.estimate` on one cluster
description: no constant belongs to a row.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazero.config import load_config
from megazero.planner.cluster import Cluster, planning_argv
from megazero.planner.estimate import Estimate, estimate

SEQ, VOCAB = 2048, 51200


@dataclass(frozen=True)
class Row:
    """One row of Table 1 with the launch script's settings."""

    name: str
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    micro_batch: int
    layers_per_virtual_stage: int | None  # interleaved schedule where given
    overlap_dp: bool  # torch DDP (overlapped all-reduce) vs Megatron's local DDP
    tflops_per_gpu: float  # published

    @property
    def flops_per_iteration(self) -> float:
        """The paper's equation 3 (full recompute counted)."""
        b, s, n_layers, h, v = self.global_batch, SEQ, self.layers, self.hidden, VOCAB
        return 96.0 * b * s * n_layers * h * h * (1 + s / (6 * h) + v / (16 * n_layers * h))

    @property
    def published_seconds(self) -> float:
        return self.flops_per_iteration / (self.gpus * self.tflops_per_gpu * 1e12)

    def argv(self) -> list[str]:
        """pretrain_gpt.py's flags for this row (the paper's settings)."""
        a = (f"--num-layers {self.layers} --hidden-size {self.hidden} --num-attention-heads "
             f"{self.heads} --seq-length {SEQ} --max-position-embeddings {SEQ} --vocab-size "
             f"{VOCAB} --make-vocab-size-divisible-by 1 --tokenizer-type NullTokenizer --fp16 "
             f"--tensor-model-parallel-size {self.tp} --pipeline-model-parallel-size {self.pp} "
             f"--micro-batch-size {self.micro_batch} --global-batch-size {self.global_batch} "
             f"--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
             f"--zero-stage 0").split()
        if self.layers_per_virtual_stage:
            a += ["--num-layers-per-virtual-pipeline-stage", str(self.layers_per_virtual_stage)]
        a.append("--overlap-grad-reduce" if self.overlap_dp else "--no-overlap-grad-reduce")
        return a


TABLE1 = [
    Row("1.7B", 1.7, 24, 2304, 24, 1, 1, 32, 512, 16, None, True, 137),
    Row("3.6B", 3.6, 32, 3072, 30, 2, 1, 64, 512, 16, None, True, 138),
    Row("7.5B", 7.5, 32, 4096, 36, 4, 1, 128, 512, 16, None, True, 142),
    Row("18.4B", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, None, True, 135),
    Row("39.1B", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, None, False, 138),
    Row("76.1B", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 5, False, 140),
    Row("145.6B", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 5, False, 148),
    Row("310.1B", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 3, False, 155),
    Row("529.6B", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 1, False, 163),
    Row("1008B", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, None, False, 163),
]

#: the paper's GPT-3 175B run (its section 1): 96 layers, hidden 12288, on 1024 A100s with
#: global batch 1536 at 140 TFLOP/s per GPU (equation 3); its layout is not part of the claim
GPT3_175B = dict(layers=96, hidden=12288, gpus=1024, global_batch=1536, tflops_per_gpu=140.0)


def gpt3_175b_published_seconds() -> float:
    """Iteration time of the paper's GPT-3 175B run, from its TFLOP/s and equation 3."""
    g = GPT3_175B
    row = Row("GPT-3 175B", 175.0, 96, int(g["hidden"]), int(g["layers"]), 8, 1,
              int(g["gpus"]), int(g["global_batch"]), 1, None, False, g["tflops_per_gpu"])
    return row.published_seconds


def predict(row: Row, cluster: Cluster) -> Estimate:
    """The planner's estimate of ``row`` run as the paper ran it."""
    cfg = load_config(planning_argv(row.argv(), cluster), row.gpus)
    stages = sorted({0, row.pp - 1})
    return estimate(cfg, cluster, flash=False, stages=stages, p2p_scatter_gather=True)
