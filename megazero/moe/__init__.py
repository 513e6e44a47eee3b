"""Mixture of Experts with expert parallelism, shaped like megatron-core's
``transformer/moe``: :mod:`~megazero.moe.router` (top-k scores, capacity, balancing losses,
expert bias), :mod:`~megazero.moe.token_dispatcher` (local, all-gather and all-to-all
dispatch), :mod:`~megazero.moe.experts` (expert loop or grouped GEMM, experts keyed by global
index), :mod:`~megazero.moe.shared_experts`, :mod:`~megazero.moe.moe_layer` (the block that
replaces an MLP) and :mod:`~megazero.moe.moe_utils` (the routing arithmetic).

The layer is built by :func:`megazero.model.transformer.build_mlp` on the layers
``--moe-layer-freq`` chooses."""
