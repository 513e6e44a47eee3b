"""The tiny DeepSeek-V3-shaped model the end-to-end tests train (with
:data:`megazero.testing.launch.TINY`): multi-latent attention with a query latent and YaRN,
layer 0 dense and layer 1 MoE (8 experts in 4 groups, 2 groups per token, sigmoid routing
with the expert bias, routed scaling, a shared expert, the sequence-wise balancing loss) and
one multi-token-prediction depth whose layer is MoE too; untied embeddings, so a pipeline's
last stage keeps a copy of the word embedding for MTP."""

DEEPSEEK = ["--num-layers", "2", "--untie-embeddings-and-output-weights",
            "--position-embedding-type", "rope", "--normalization",
            "RMSNorm", "--swiglu", "--disable-bias-linear", "--multi-latent-attention",
            "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "6",
            "--qk-pos-emb-head-dim", "4", "--v-head-dim", "10", "--rotary-scaling-factor", "4",
            "--mscale", "1.0", "--mscale-all-dim", "0.7", "--original-max-position-embeddings",
            "8", "--num-experts", "8", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
            "--moe-layer-freq", "[0,1]", "--moe-router-score-function", "sigmoid",
            "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05",
            "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "4",
            "--moe-router-group-topk", "2", "--moe-shared-expert-intermediate-size", "16",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3",
            "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3", "--train-iters", "4"]
