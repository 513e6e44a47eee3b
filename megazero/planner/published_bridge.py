"""Published runs the step-time model is checked against: Megatron-Bridge's DGX-H100 table.

NVIDIA's Megatron-Bridge performance summary, 25.11 NeMo container, system DGX-H100
(``docs/performance-summary.md`` in NVIDIA-NeMo/Megatron-Bridge, the 25.11 section as corrected
in commit 5776a6d9, "25.11 summary typo corrections", whose Qwen3-235B row is whole; the
first 25.11 version, 97ad8cc6, lacks that row's GBS). DGX H100 nodes: 8 H100 SXM, NVSwitch,
8 x 400 Gb/s InfiniBand. Each row gives model, GPUs, precision, GBS, MBS, sequence, FSDP, TP,
PP, CP, VP, EP and the model TFLOP/s per GPU, counted with Megatron-Bridge's own formula
(``num_floating_point_operations`` in ``src/megatron/bridge/training/utils/flop_utils.py``,
:func:`bridge_flops_per_token` here). MoE rows route force-balanced and drop no token.

What the rows use and where it comes from:

* layout columns as written in the table; the rest (recompute, overlap switches, dispatcher)
  from the performance recipes of the same commit (``scripts/performance/configs/*/
  *_workload_base_configs.py`` and ``*_llm_pretrain.py``) and the library recipes they build
  on (``src/megatron/bridge/recipes``): distributed optimizer with overlapped gradient
  reduce-scatter and parameter all-gather, sequence parallelism whenever TP > 1;
* FP8 rows: per-tensor current scaling in every transformer layer, parameters all-gathered in
  FP8 (``bf16_with_fp8_current_scaling_mixed``, ``fp8_param_gather=True``);
* where the table and the recipe disagree: Llama-3 8B's table says FSDP over the 8 GPUs (its
  recipe file has none; the table decides the layout) and the recipe adds full recompute of
  5 layers (block); GPT-OSS 120B's MBS 4 contradicts the table's own GA 2 (GBS 512 / (MBS 4 x
  DP 16) is 8, and GA 2 needs 64 data-parallel ranks, impossible at PP 4): MBS 1 from the
  recipe, GA 32;
* features megazero does not have are priced as the row uses them
  (:class:`megazero.planner.features.Features`): FP8, TP communication inside the GEMMs
  (Llama-3 70B and 405B: ``tp_comm_overlap``), the combined-1F1B expert-parallel overlap
  (Qwen3: ``moe_a2a_overlap``), Megatron's embedding and loss pipeline slots (Llama-3.1 405B,
  Qwen3-235B), GPT-OSS's sliding window (128 positions on every other layer) and its
  recomputed norms and expert activation.

:func:`predict` times a row with :func:`megazero.planner.estimate.estimate` on one cluster
description; no constant belongs to a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megazero.config import load_config
from megazero.planner.cluster import Cluster, planning_argv
from megazero.planner.estimate import Estimate, estimate
from megazero.planner.features import Features

SOURCE = ("Megatron-Bridge docs/performance-summary.md, 25.11 NeMo container, DGX-H100 "
          "(NVIDIA-NeMo/Megatron-Bridge commit 5776a6d9); settings from "
          "scripts/performance/configs at the same commit")

LLAMA = ("--swiglu --normalization RMSNorm --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0 "
         "--hidden-dropout 0 --group-query-attention")


@dataclass(frozen=True)
class Shape:
    """What Megatron-Bridge's FLOP formula reads from a model's config."""

    layers: int
    hidden: int
    heads: int
    query_groups: int
    kv_channels: int
    ffn: int  # dense MLP
    vocab: int  # the tokenizer's, before padding
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    gated_silu: bool = True  # the 3/2 GLU multiplier: gated linear unit with F.silu only


@dataclass(frozen=True)
class BridgeRow:
    """One DGX-H100 row of the table, with the flags and features it runs with."""

    name: str
    shape: Shape
    gpus: int
    precision: str  # "FP8-CS" or "BF16", as the table writes it
    global_batch: int
    micro_batch: int
    seq: int
    fsdp: bool
    tp: int
    pp: int
    cp: int
    vp: int | None
    ep: int
    tokens_per_s_per_gpu: float  # published
    tflops_per_gpu: float  # published, Megatron-Bridge's formula
    flags: str  # model and run flags beyond the layout columns
    features: Features = field(default_factory=Features)

    @property
    def moe(self) -> bool:
        return self.shape.experts > 0

    @property
    def flops_per_iteration(self) -> float:
        return self.global_batch * self.seq * bridge_flops_per_token(self.shape, self.seq,
                                                                     self.tp)

    @property
    def published_seconds(self) -> float:
        return self.flops_per_iteration / (self.gpus * self.tflops_per_gpu * 1e12)

    def argv(self) -> list[str]:
        sh = self.shape
        slots = 2 if self.features.embedding_and_loss_slots else 0
        a = (f"--num-layers {sh.layers + slots} --hidden-size {sh.hidden} --num-attention-heads "
             f"{sh.heads} --num-query-groups {sh.query_groups} --kv-channels {sh.kv_channels} "
             f"--ffn-hidden-size {sh.ffn} --seq-length {self.seq} --max-position-embeddings "
             f"{self.seq} --vocab-size {sh.vocab} --tokenizer-type NullTokenizer --bf16 "
             f"--micro-batch-size {self.micro_batch} --global-batch-size {self.global_batch} "
             f"--tensor-model-parallel-size {self.tp} --pipeline-model-parallel-size {self.pp} "
             f"--context-parallel-size {self.cp} --zero-stage {3 if self.fsdp else 1} "
             f"--overlap-grad-reduce --overlap-param-gather {self.flags}").split()
        if self.tp > 1:
            a.append("--sequence-parallel")
        if self.vp:
            a += ["--num-layers-per-virtual-pipeline-stage",
                  str((sh.layers + slots) // (self.pp * self.vp))]
        if self.moe:
            a += (f"--num-experts {sh.experts} --moe-router-topk {sh.topk} --moe-ffn-hidden-size "
                  f"{sh.moe_ffn} --moe-token-dispatcher-type alltoall --moe-grouped-gemm "
                  f"--expert-model-parallel-size {self.ep} --expert-tensor-parallel-size 1 "
                  f"--moe-router-load-balancing-type none").split()
        return a


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-Bridge's ``calculate_padded_vocab_size``: a multiple of 128 x TP."""
    multiple = divisible_by * tp
    return math.ceil(vocab / multiple) * multiple


def bridge_flops_per_token(sh: Shape, seq: int, tp: int) -> float:
    """Megatron-Bridge's ``transformer_flops()`` per token (forward and backward, the ``12 =
    3 x 2 x 2`` expansion): MLP ``12 l h f g`` (``g`` = 3/2 for a SiLU-gated unit only, so
    GPT-OSS's gated quick-GELU counts 1), or for MoE layers ``12 l h f_moe k g``; attention
    ``12 l h^2 (1 + G/a + s/(2h)) (a d / h)`` (the causal half of the square); logits
    ``6 h V_padded``. No router, no recompute."""
    g = 1.5 if sh.gated_silu else 1.0
    mlp = sh.moe_ffn * sh.topk * g if sh.experts else sh.ffn * g
    ratio = sh.kv_channels * sh.heads / sh.hidden
    attn = sh.hidden * sh.hidden * (1 + sh.query_groups / sh.heads + seq / sh.hidden / 2) * ratio
    return (12 * sh.layers * (sh.hidden * mlp + attn)
            + 6 * sh.hidden * padded_vocab(sh.vocab, tp))


LLAMA3_8B = Shape(32, 4096, 32, 8, 128, 14336, 128256)
LLAMA3_70B = Shape(80, 8192, 64, 8, 128, 28672, 128256)
LLAMA31_405B = Shape(126, 16384, 128, 8, 128, 53248, 128256)
GPT_OSS_120B = Shape(36, 2880, 64, 8, 64, 2880, 201088, experts=128, topk=4, moe_ffn=2880,
                     gated_silu=False)
QWEN3_30B_A3B = Shape(48, 2048, 32, 4, 128, 6144, 151936, experts=128, topk=8, moe_ffn=768)
QWEN3_235B_A22B = Shape(94, 4096, 64, 4, 128, 12288, 151936, experts=128, topk=8,
                        moe_ffn=1536)

_FP8 = dict(fp8="tensorwise", fp8_param_gather=True)
#: the recipes reduce and accumulate gradients in bf16 (``grad_reduce_in_fp32 = False``)
BF16_GRADS = {"data_types": {"grad_accum_dtype": "bf16"}}

BRIDGE_H100 = [
    BridgeRow("Llama-3 8B", LLAMA3_8B, 8, "FP8-CS", 128, 1, 8192, True, 1, 1, 1, None, 1,
              14451, 744, f"{LLAMA} --rotary-base 500000 --recompute-granularity full "
              "--recompute-method block --recompute-num-layers 5", Features(**_FP8)),
    BridgeRow("Llama-3 70B", LLAMA3_70B, 64, "FP8-CS", 128, 1, 8192, False, 4, 8, 1, 5, 1,
              1602, 719, f"{LLAMA} --rotary-base 500000",
              Features(**_FP8, tp_comm_overlap=True)),
    BridgeRow("Llama-3.1 405B", LLAMA31_405B, 1024, "FP8-CS", 512, 1, 8192, False, 8, 8, 2, 8,
              1, 292, 737, f"{LLAMA} --rotary-base 500000",
              Features(**_FP8, tp_comm_overlap=True, embedding_and_loss_slots=True)),
    BridgeRow("GPT-OSS 120B", GPT_OSS_120B, 64, "BF16", 512, 1, 4096, False, 1, 4, 1, None, 8,
              5630, 153, "--swiglu --normalization RMSNorm --position-embedding-type rope "
              "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 "
              "--group-query-attention",
              Features(sliding_window=128, sliding_window_share=0.5,
                       recompute_norms_and_moe_act=True)),
    BridgeRow("Qwen3-30B-A3B", QWEN3_30B_A3B, 16, "FP8-CS", 512, 2, 4096, False, 1, 2, 1, 24,
              8, 5275, 121, f"{LLAMA} --qk-layernorm", Features(**_FP8, moe_ep_overlap=True)),
    BridgeRow("Qwen3-235B-A22B", QWEN3_235B_A22B, 256, "FP8-CS", 2048, 1, 4096, False, 2, 8,
              1, 4, 32, 1575, 233, f"{LLAMA} --qk-layernorm",
              Features(**_FP8, moe_ep_overlap=True, embedding_and_loss_slots=True)),
]


#: the bound on predicted / published time: 15% for dense rows, 20% for MoE rows
DENSE_BOUND, MOE_BOUND = 0.15, 0.20


def bound(row: BridgeRow) -> float:
    return MOE_BOUND if row.moe else DENSE_BOUND


#: not published rows: Mixtral 8x7B on 8 DGX H100 nodes (64 GPUs), bf16, sequence 4096, the
#: all-to-all dispatcher, ZeRO-1, global batch 256, in two layouts: the expert group of 8
#: inside a node (TP 1, PP 4, EP 8: megatron-core's MoE guide's layout for this model) and
#: spread over two nodes (TP 2 with SP and expert TP 2: 16 ranks per expert group); the runs
#: whose MoE terms the table's MoE rows are read against
MIXTRAL_LAYOUTS = {
    "ep 8 in a node (tp 1, pp 4)": "--pipeline-model-parallel-size 4",
    "ep 8 over two nodes (tp 2, etp 2)": "--tensor-model-parallel-size 2 --sequence-parallel "
                                         "--expert-tensor-parallel-size 2",
}
MIXTRAL_8X7B = (
    "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 "
    "--ffn-hidden-size 14336 --seq-length 4096 --max-position-embeddings 4096 --vocab-size "
    "32000 --tokenizer-type NullTokenizer --bf16 --micro-batch-size 1 --global-batch-size 256 "
    f"--zero-stage 1 --overlap-grad-reduce --overlap-param-gather {LLAMA} --num-experts 8 "
    "--moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-grouped-gemm "
    "--expert-model-parallel-size 8 --moe-router-load-balancing-type none")


def predict_mixtral(cluster: Cluster, layout: str, world: int = 64) -> Estimate:
    """The planner's estimate of Mixtral 8x7B in one of :data:`MIXTRAL_LAYOUTS`."""
    argv = f"{MIXTRAL_8X7B} {MIXTRAL_LAYOUTS[layout]}".split()
    cfg = load_config(planning_argv(argv, cluster), world)
    return estimate(cfg, cluster, stages=sorted({0, cfg.parallel.pp - 1}))


def predict(row: BridgeRow, cluster: Cluster) -> Estimate:
    """The planner's estimate of ``row`` run as Megatron-Bridge ran it."""
    cfg = load_config(planning_argv(row.argv(), cluster), row.gpus, ds_config=BF16_GRADS)
    return estimate(cfg, cluster, stages=sorted({0, row.pp - 1}), features=row.features)
