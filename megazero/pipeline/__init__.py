"""Pipeline parallelism: layer partitioning, schedules as data, their checker, p2p, executor.

Training-loop use, per iteration (every rank)::

    chunks = build_model_chunks(model_config, topo, layers_per_virtual_stage, ...)  # once
    losses = forward_backward(chunks, data_iterator, topo, num_microbatches, seq_length,
                              micro_batch_size, hidden_size, sequence_parallel=sp,
                              grad_sync=engine)
    engine.finish_grad_sync()   # dp reduction, sequence-parallel and tied-embedding sums
    engine.step()

``engine`` is a :class:`megazero.pipeline.grad_sync.GradSync` (the ZeRO engine at any stage; stage 0
without ZeRO).
"""

from megazero.pipeline.checker import ScheduleError, SimResult, check_schedules, render_grid
from megazero.pipeline.executor import forward_backward
from megazero.pipeline.grads import sync_tied_embeddings
from megazero.pipeline.partition import build_model_chunks, chunk_layer_ranges, chunk_roles
from megazero.pipeline.schedules import Action, build_all, build_schedule

__all__ = [
    "Action", "ScheduleError", "SimResult", "build_all", "build_model_chunks", "build_schedule",
    "check_schedules", "chunk_layer_ranges", "chunk_roles", "forward_backward", "render_grid",
    "sync_tied_embeddings",
]
