"""Combined 1F1B (Megatron's ``--overlap-moe-expert-parallel-comm``): in training, the forward
of one micro-batch and the backward of another run in turns, layer by layer, so that each
one's MoE all-to-alls travel while the other computes.

- :mod:`megazero.combined_1f1b.duet`: the two passes and their turns at the all-to-alls;
- :mod:`megazero.pipeline.combined`: which forward and backward steps of a pipeline
  schedule run together (no pipelining, the interleaved schedule, DualPipeV).
"""
