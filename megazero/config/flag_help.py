"""What ``pretrain_gpt.py --help`` says about each flag, and under which heading.

Kept beside :data:`megazero.config.cli.FLAGS` rather than inside it so the flag table stays one
line per flag. Headings follow Megatron's argument groups. A flag's group comes from
:data:`GROUP_OF_FLAG` when listed there, else from the section of the config field it fills
(:data:`GROUP_OF_SECTION`), so a new flag lands under a sensible heading without an edit here.
"""

from __future__ import annotations

GROUPS = ("model", "mixture of experts", "parallelism", "training", "learning rate", "validation",
          "data",
          "checkpointing", "logging", "mixed precision", "ZeRO and DeepSpeed config",
          "distributed")

GROUP_OF_SECTION = {
    "model": "model", "parallel": "parallelism", "train": "training", "optimizer": "training",
    "data": "data", "checkpoint": "checkpointing", "logging": "logging",
    "precision": "mixed precision", "zero": "ZeRO and DeepSpeed config",
}

GROUP_OF_FLAG = {
    "--expert-model-parallel-size": "parallelism",
    "--expert-tensor-parallel-size": "parallelism",
    "--num-experts": "mixture of experts",
    "--moe-ffn-hidden-size": "mixture of experts",
    "--moe-layer-freq": "mixture of experts",
    "--moe-router-topk": "mixture of experts",
    "--moe-router-score-function": "mixture of experts",
    "--moe-router-pre-softmax": "mixture of experts",
    "--moe-router-topk-scaling-factor": "mixture of experts",
    "--moe-router-load-balancing-type": "mixture of experts",
    "--moe-aux-loss-coeff": "mixture of experts",
    "--moe-z-loss-coeff": "mixture of experts",
    "--moe-router-enable-expert-bias": "mixture of experts",
    "--moe-router-bias-update-rate": "mixture of experts",
    "--moe-expert-capacity-factor": "mixture of experts",
    "--moe-token-drop-policy": "mixture of experts",
    "--moe-pad-expert-input-to-capacity": "mixture of experts",
    "--moe-grouped-gemm": "mixture of experts",
    "--moe-shared-expert-intermediate-size": "mixture of experts",
    "--moe-shared-expert-gate": "mixture of experts",
    "--moe-shared-expert-overlap": "mixture of experts",
    "--moe-token-dispatcher-type": "mixture of experts",
    "--moe-per-layer-logging": "mixture of experts",
    "--moe-router-num-groups": "mixture of experts",
    "--moe-router-group-topk": "mixture of experts",
    "--moe-router-dtype": "mixture of experts",
    "--lr": "learning rate", "--min-lr": "learning rate", "--lr-decay-style": "learning rate",
    "--lr-warmup-iters": "learning rate", "--lr-decay-iters": "learning rate",
    "--lr-warmup-fraction": "learning rate", "--lr-warmup-samples": "learning rate",
    "--lr-decay-samples": "learning rate",
    "--override-opt_param-scheduler": "learning rate",
    "--use-checkpoint-opt_param-scheduler": "learning rate",
    "--eval-interval": "validation", "--eval-iters": "validation",
    "--distributed-backend": "distributed",
    "--deepspeed_config": "ZeRO and DeepSpeed config", "--deepspeed": "ZeRO and DeepSpeed config",
    "--log-json": "logging",
    "--wall-clock-breakdown": "logging",
}

HELP = {
    # mixture of experts
    "--expert-model-parallel-size":
        "ranks that split each MoE layer's experts (EP); E must divide by it",
    "--expert-tensor-parallel-size":
        "ranks that split each expert's matrices (only 1 in megazero)",
    "--num-experts":
        "experts per MoE layer (E): the chosen layers' MLP becomes router + experts",
    "--moe-ffn-hidden-size":
        "each expert's hidden width (default: --ffn-hidden-size)",
    "--moe-layer-freq":
        "MoE layers: an int N (layer i when i % N == 0) or a 0/1 list per layer",
    "--moe-router-topk":
        "experts each token is routed to (k)",
    "--moe-router-score-function":
        "router scores: softmax over experts, or per-expert sigmoid",
    "--moe-router-pre-softmax":
        "softmax over all experts before choosing the top k",
    "--moe-router-topk-scaling-factor":
        "multiply the routing weights by this factor",
    "--moe-router-load-balancing-type":
        "balancing loss: switch loss per micro-batch (aux_loss), per sequence, or none",
    "--moe-aux-loss-coeff":
        "weight of the load-balancing loss (1e-2 is usual)",
    "--moe-z-loss-coeff":
        "weight of the router z-loss (1e-3 is usual)",
    "--moe-router-enable-expert-bias":
        "aux-loss-free balancing: a per-expert bias on sigmoid scores, updated each step",
    "--moe-router-bias-update-rate":
        "step of the expert-bias update, b += rate * sign(mean(c) - c)",
    "--moe-expert-capacity-factor":
        "tokens an expert takes, as a multiple of k T / E (default: dropless)",
    "--moe-token-drop-policy":
        "over capacity, keep the highest-weight tokens or the first ones",
    "--moe-pad-expert-input-to-capacity":
        "pad every expert's input to its capacity (fixed shapes)",
    "--moe-grouped-gemm":
        "run the local experts as one grouped GEMM instead of a loop",
    "--moe-shared-expert-intermediate-size":
        "width of a dense shared expert every token passes",
    "--moe-shared-expert-gate":
        "scale the shared expert's output by sigmoid(x g) per token",
    "--moe-router-num-groups":
        "split the experts into this many equal groups (nodes) for group-limited routing",
    "--moe-router-group-topk":
        "groups each token may route to: its top-k comes from its best groups",
    "--moe-router-dtype":
        "precision of the router's logits and choice (fp32, or fp64)",
    "--moe-token-dispatcher-type":
        "how tokens reach their experts' ranks: all-gather or all-to-all",
    "--moe-per-layer-logging":
        "log the balancing loss and expert counts of every MoE layer",
    # parallelism
    "--tensor-model-parallel-size": "ranks that split each layer's matrices (TP)",
    "--pipeline-model-parallel-size": "pipeline stages the layers are divided into (PP)",
    "--num-layers-per-virtual-pipeline-stage":
        "layers per virtual chunk: turns on the interleaved 1F1B schedule",
    "--microbatch-group-size-per-virtual-pipeline-stage":
        "interleaved schedule: micro-batches that pass each model chunk in a row, N with "
        "pp <= N <= micro-batches per iteration and a last group empty or >= pp (default pp)",
    "--sequence-parallel": "split LayerNorm/dropout activations along the sequence over TP ranks",
    "--recompute-granularity": "activation recompute: full layers or the attention core only",
    "--recompute-method": "with full recompute: every N layers (uniform) or the first N (block)",
    "--recompute-num-layers": "N for --recompute-method",
    "--distribute-saved-activations": "full recompute at tp > 1 without SP: each TP rank keeps "
                                      "1/tp of every layer group's input",
    "--distributed-backend": "torch.distributed backend (default: nccl on GPU, gloo on CPU)",
    # model
    "--model-preset": "start the model from a preset; flags given explicitly override it",
    "--rotary-percent": "the share of each head's dims that RoPE rotates, as GPT-NeoX's "
                        "rotary_pct (the rest pass through)",
    "--rampup-batch-size": "START INCREMENT SAMPLES: the global batch grows from START by "
                           "INCREMENT in equal steps over the first SAMPLES samples, then stays "
                           "at --global-batch-size (Megatron's ramp-up)",
    "--manual-gc": "turn Python's automatic garbage collection off (stalls on one rank hold "
                   "up all); collect every --manual-gc-interval iterations",
    "--manual-gc-interval": "iterations between collections with --manual-gc (0: none while "
                            "training)",
    "--no-manual-gc-eval": "with --manual-gc, do not collect around evaluation",
    "--eod-mask-loss": "no loss on the token that follows an end-of-document token",
    "--log-num-zeros-in-grad": "count the gradient's zero elements and log them each line",
    "--profile": "profile iterations [--profile-step-start, --profile-step-end) on "
                 "--profile-ranks (nsys range, or torch.profiler with --use-pytorch-profiler)",
    "--use-pytorch-profiler": "--profile through torch.profiler: a table of the top kernels "
                              "and a Chrome trace",
    "--profile-step-start": "first profiled iteration (default 10)",
    "--profile-step-end": "profiling stops before this iteration (default 12)",
    "--profile-ranks": "global ranks that profile (default 0)",
    "--num-layers": "transformer layers",
    "--hidden-size": "model width",
    "--num-attention-heads": "attention heads per layer",
    "--group-query-attention": "grouped-query attention (with --num-query-groups)",
    "--num-query-groups": "key/value heads for grouped-query attention",
    "--ffn-hidden-size": "MLP width (default 4 x hidden, 8/3 x hidden with --swiglu)",
    "--seq-length": "tokens per training sample",
    "--max-position-embeddings": "learned position table size (default --seq-length)",
    "--position-embedding-type": "learned absolute positions or rotary (RoPE)",
    "--rotary-base": "RoPE base frequency",
    "--normalization": "normalization layer",
    "--norm-epsilon": "epsilon of the normalization layers",
    "--swiglu": "SwiGLU MLP instead of GELU",
    "--disable-bias-linear": "no bias in the linear layers",
    "--add-qkv-bias": "a bias on the QKV projection even with --disable-bias-linear (Qwen2)",
    "--untie-embeddings-and-output-weights": "separate output layer instead of the embedding",
    "--attention-dropout": "dropout on the attention probabilities",
    "--hidden-dropout": "dropout on the residual branches",
    "--init-method-std": "standard deviation of the weight initialisation",
    "--make-vocab-size-divisible-by": "pad the vocabulary to a multiple of this x TP size",
    "--vocab-size": "vocabulary size with --mock-data / NullTokenizer",
    "--use-flash-attn": "use flash-attn when installed and on GPU",
    "--no-flash-attn": "never use flash-attn",
    "--kv-channels": "per-head width (default --hidden-size / --num-attention-heads)",
    "--qk-layernorm": "--normalization over each head's queries and keys before RoPE (Qwen3)",
    "--bias-gelu-fusion": "fc1's bias add and GELU in one compiled kernel (on GPU)",
    "--no-bias-gelu-fusion": "bias add and GELU as separate eager kernels",
    "--bias-swiglu-fusion": "fc1's bias add and SwiGLU in one compiled kernel (on GPU)",
    "--no-bias-swiglu-fusion": "bias add and SwiGLU as separate eager kernels",
    "--bias-dropout-fusion": "the output projections' bias add and the residual add in one "
                             "compiled kernel (on GPU; with hidden dropout > 0 the mask is "
                             "drawn eagerly, unfused)",
    "--no-bias-dropout-fusion": "bias, dropout and residual add as separate eager kernels",
    "--apply-rope-fusion": "the rotary embedding of queries and keys in one compiled kernel "
                           "(on GPU)",
    "--no-rope-fusion": "the rotary embedding as eager kernels",
    "--fusions-on-cpu": "run the enabled fusions compiled on CPU too (for tests; not faster)",
    "--attention-softmax-in-fp32": "accepted: the attention softmax always runs in fp32",
    # training
    "--micro-batch-size": "samples per rank per forward/backward",
    "--global-batch-size": "samples per optimizer step over all data-parallel ranks",
    "--train-iters": "optimizer steps to train",
    "--train-samples": "samples to train (instead of --train-iters)",
    "--seed": "random seed",
    "--deterministic-mode": "bitwise-reproducible GPU runs: deterministic kernels, fixed cuBLAS "
                            "workspace (slower)",
    "--openai-gelu": "tanh-approximated GELU (GPT-2's gelu_new) instead of the exact one",
    "--log-memory-phases": "log device memory after forward, backward and the optimizer step "
                           "(TensorBoard mem-after-* tags)",
    "--exit-interval": "stop (and save) after an iteration that is a multiple of this",
    "--exit-duration-in-mins": "stop (and save) after this many minutes",
    "--exit-signal-handler": "accepted: SIGTERM always saves a checkpoint and exits",
    "--skip-train": "no training: evaluate the loaded model on the validation set only",
    "--optimizer": "adam (default: Adam with decoupled weight decay, as Megatron's adam) or "
                   "sgd; the JSON optimizer.type also takes Adam with adam_w_mode false (L2 "
                   "decay)",
    "--sgd-momentum": "SGD momentum (with --optimizer sgd)",
    "--weight-decay": "weight decay (decoupled for adam; L2 for sgd)",
    "--adam-beta1": "Adam beta1",
    "--adam-beta2": "Adam beta2",
    "--adam-eps": "Adam epsilon",
    "--clip-grad": "global gradient-norm clipping (0 disables)",
    # learning rate
    "--lr": "peak learning rate",
    "--min-lr": "learning rate the decay ends at",
    "--lr-decay-style": "learning-rate decay after warm-up",
    "--lr-warmup-iters": "linear warm-up steps from 0 to --lr",
    "--lr-warmup-fraction": "warm-up as a fraction of the decay steps",
    "--lr-warmup-samples": "warm-up length in samples (a multiple of the global batch)",
    "--lr-decay-iters": "steps over which the rate decays (default --train-iters)",
    "--lr-decay-samples": "decay length in samples (a multiple of the global batch)",
    "--override-opt_param-scheduler":
        "on resume, use the schedule flags given now instead of refusing a different one",
    "--use-checkpoint-opt_param-scheduler":
        "on resume, keep the checkpoint's schedule settings and ignore the flags",
    # validation
    "--eval-interval": "iterations between validation runs",
    "--eval-iters": "global batches per validation run (0 disables)",
    # mixed precision
    "--fp16": "fp16 mixed precision with dynamic loss scaling (fp32 master weights)",
    "--bf16": "bf16 mixed precision (fp32 master weights)",
    "--fp8-format": "FP8 GEMMs in the transformer layers' linears: e4m3 everywhere, or hybrid "
                    "(e5m2 output gradients)",
    "--fp8-recipe": "FP8 scaling: tensorwise (current), delayed (amax history), blockwise "
                    "(1x128 / 128x128, DeepSeek-V3), mxfp8 (Blackwell only)",
    "--fp8-amax-history-len": "delayed scaling: steps of amax history",
    "--fp8-amax-compute-algo": "delayed scaling: most_recent or max of the history",
    "--fp8-margin": "delayed scaling: binades of headroom below the FP8 maximum",
    "--first-last-layers-bf16": "keep the first and last layers' GEMMs in bf16 under FP8",
    "--num-layers-at-start-in-bf16": "with --first-last-layers-bf16: layers at the start",
    "--num-layers-at-end-in-bf16": "with --first-last-layers-bf16: layers at the end",
    "--log-fp8-amax": "FP8 tensors whose amax the log line and TensorBoard carry: patterns "
                      "over <module>.<x|w|dy>, e.g. 'decoder.layers.1.*.x'",
    "--fp8-param-gather": "ZeRO all-gathers the FP8 GEMM weights as e4m3 bytes with their "
                          "scales, half bf16's bytes (ZeRO-3: tensorwise; ZeRO 1-2: 16-bit "
                          "parameters, any recipe, current scales)",
    "--loss-scale": "static loss scale (0: dynamic)",
    "--initial-loss-scale": "initial dynamic loss scale, a power of two (default 65536 = 2**16)",
    "--min-loss-scale": "smallest dynamic loss scale; overflowing there stops the run",
    "--loss-scale-window": "clean steps before the dynamic scale doubles",
    "--hysteresis": "overflows tolerated before the dynamic scale halves",
    "--accumulate-allreduce-grads-in-fp32":
        "accumulate gradients over micro-batches and reduce them over data-parallel ranks in "
        "fp32 (default: on with --bf16, where data_types.grad_accum_dtype \"bf16\" in the "
        "JSON turns it off; off with --fp16)",
    # ZeRO and DeepSpeed
    "--zero-stage": "ZeRO stage; the same as zero_optimization.stage in the JSON",
    "--deepspeed_config": "DeepSpeed JSON config (comments, trailing commas allowed; \"auto\" "
                          "takes the flags)",
    "--deepspeed": "accepted for Megatron-DeepSpeed scripts; no effect",
    "--overlap-grad-reduce": "reduce each gradient bucket as soon as it is full, behind the rest "
                             "of backward (default: on with NCCL, off on gloo; "
                             "zero_optimization.overlap_comm)",
    "--no-overlap-grad-reduce": "reduce the gradient buckets after backward (default on gloo)",
    "--overlap-param-gather": "ZeRO 1-2: all-gather the updated parameters per bucket in the "
                              "background; the next forward waits for each bucket where it "
                              "first uses it (default: on with NCCL, off on gloo)",
    "--no-overlap-param-gather": "ZeRO 1-2: all-gather the parameters inside the step (default "
                                 "on gloo)",
    "--ddp-bucket-size": "elements per gradient bucket (default: max(40M, 1M x dp) with NCCL, "
                         "5e8 on gloo; zero_optimization.reduce_bucket_size)",
    # data
    "--data-path": '"PREFIX" or "W1 PREFIX1 W2 PREFIX2 ..." (weights for blending)',
    "--split": "train,valid,test proportions of --data-path",
    "--mock-data": "random tokens instead of a corpus (no files needed)",
    "--tokenizer-type": "tokenizer of the corpus",
    "--tokenizer-model": "SentencePiece .model file, or tokenizer.json / its directory",
    "--vocab-file": "GPT2BPETokenizer vocab.json",
    "--merge-file": "GPT2BPETokenizer merges.txt",
    "--data-cache-path": "where sample indices (and the demo corpus) are cached",
    "--num-workers": "accepted for Megatron scripts: samples are read from mmap in-process",
    # checkpointing
    "--save": "directory to save checkpoints to",
    "--load": "directory to resume from (must exist unless it is also --save)",
    "--save-interval": "iterations between checkpoints",
    "--no-load-optim": "do not load the optimizer state (fresh Adam moments)",
    "--no-load-rng": "do not load the random-number-generator states",
    "--finetune": "load weights only: iteration 0, fresh optimizer and schedule",
    "--overwrite-checkpoints": "start a new run in a --save directory that holds another run's "
                               "newer checkpoints (refused otherwise): they are replaced as this "
                               "run reaches their iterations",
    "--use-checkpoint-args": "take the model's shape (layers, widths, heads, positions, norm...) "
                             "from the --load checkpoint instead of the flags",
    # logging
    "--log-interval": "iterations between log lines",
    "--tensorboard-dir": "write TensorBoard scalars here",
    "--log-json": "also append every logged iteration's metrics to this file as JSON lines",
    "--wall-clock-breakdown": "print where each iteration's time goes (forward, backward, each "
                              "collective's launch and wait, optimizer, data, logging), "
                              "adding up to the loop time (the JSON's wall_clock_breakdown)",
}
