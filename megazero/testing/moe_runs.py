"""The tiny MoE model the end-to-end tests train (with :data:`megazero.testing.launch.TINY`):
it drops tokens (capacity factor 1.0), routes by sigmoid with the aux-loss-free expert bias,
has a gated shared expert, an aux loss and a z-loss, and MoE layers on layers 0 and 2 only
(so a 2-stage interleaved pipeline has a stage without any MoE layer)."""

MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "24", "--moe-router-topk", "2",
       "--moe-layer-freq", "2", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05",
       "--moe-expert-capacity-factor", "1.0", "--moe-aux-loss-coeff", "1e-2",
       "--moe-z-loss-coeff", "1e-3", "--moe-shared-expert-intermediate-size", "16",
       "--moe-shared-expert-gate", "--train-iters", "4", "--eval-interval", "4",
       "--eval-iters", "1", "--distributed-backend", "gloo"]
