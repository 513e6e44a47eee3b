"""One training iteration and one evaluation: the pipeline schedule over a global batch's
micro-batches, the gradient sync, the optimizer step with its one scalar all-reduce, the learning
rate.

One iteration on every rank::

    losses = forward_backward(chunks, train_iter, topo, m, ...)   # m micro-batches, 1F1B
    engine.finish_grad_sync()      # dp reduce (-scatter), TP-SP and tied-embedding sums
    result = engine.step()         # overflow check, grad norm + clip, AdamW on the shard
    scheduler.step()               # only after an update, as Megatron and DeepSpeed do

The reported ``lm loss`` is the mean of the per-micro-batch token means over all micro-batches
and data-parallel ranks, the same number a one-process run on the whole global batch computes.
Rank 0 reports (the pipeline executor returns the losses on every pipeline rank).

With ``--calculate-per-token-loss`` (Megatron's) the loss is instead the sum over every loss
token of the global batch divided by their count: each micro-batch back-propagates its token
sum (scaled so the executor's and the gradient reduction's averages cancel), the token counts
ride in the optimizer step's scalar all-reduce, and the engine divides the reduced gradients by
the global count before the norm, the clip and the update.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megazero.distributed.topology import ParallelTopology
from megazero.errors import DataError
from megazero.observability.monitor import Timers
from megazero.pipeline.activation_meter import ActivationMeter
from megazero.training.builders import batch_iterator, get_batch
from megazero.training.run import Run


def _schedule(run: Run, data_iter: Iterator[dict[str, Any]], forward_only: bool,
              activation_meter: ActivationMeter | None = None,
              num_microbatches: int | None = None,
              token_sums: list[tuple[float, float]] | None = None) -> list[float]:
    """One pass of the pipeline schedule over ``num_microbatches`` micro-batches (default: a
    full global batch's); returns their mean losses. ``token_sums``: per-token loss
    (``--calculate-per-token-loss``): this rank's ``(loss sum, token count)`` of each
    micro-batch are appended (on the last pipeline stage), the losses returned are not means."""
    from megazero.pipeline.executor import default_loss_fn, forward_backward

    scale = run.engine.loss_scale if (run.cfg.precision.fp16 and not forward_only) else 1.0
    m = run.cfg.model
    count = num_microbatches or run.batching.num_microbatches
    # per-token: the executor divides by the micro-batch count and the gradient reduction by
    # the dp x cp replicas; this factor cancels both, leaving the sum over the global batch
    per_token_factor = count * run.topo.grad_size

    # the chunk with the output layer holds the MTP depths (the last, or under a V-shaped
    # schedule another of this rank's chunks)
    mtp_chunk = next((c for c in run.chunks if getattr(c, "mtp", None) is not None),
                     run.chunks[-1])

    def loss_fn(per_token: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        # fp16: the executor back-propagates what this returns, so the loss scale goes here;
        # the scale is a power of two, so dividing the reported loss by it below is exact.
        if token_sums is not None:
            mask = batch.get("loss_mask")
            loss = per_token.float() if mask is None else per_token.float() * mask.float()
            tokens = float(per_token.numel() if mask is None else mask.float().sum())
            token_sums.append((float(loss.detach().sum()), tokens))
            return loss.sum() * (per_token_factor * scale)
        if run.topo.cp_size > 1:  # the micro-batch's tokens are split over the CP group
            from megazero.context_parallel.loss import exact_mean_loss

            loss = exact_mean_loss(per_token, batch.get("loss_mask"), run.topo.cp_group) * scale
        else:
            loss = default_loss_fn(per_token, batch) * scale
        if m.mtp_num_layers:  # the MTP depths' losses ride the backward (model.mtp)
            from megazero.model.mtp import add_mtp_loss

            loss = add_mtp_loss(loss, mtp_chunk, batch, run.topo, scale)
        return loss

    if m.moe.enabled:  # MoE auxiliary losses are scaled as each micro-batch's loss is
        from megazero.moe.moe_utils import set_aux_loss_scale

        # per-token: summed, not averaged, over micro-batches and replicas (Megatron's)
        set_aux_loss_scale(scale * run.topo.grad_size if token_sums is not None
                           else scale / count)
    losses = forward_backward(
        run.chunks, data_iter, run.topo,
        num_microbatches or run.batching.num_microbatches, m.seq_length // run.topo.cp_size,
        run.batching.micro_batch_size, m.hidden_size, forward_only=forward_only,
        sequence_parallel=run.sp, dtype=run.cfg.precision.params_dtype, loss_fn=loss_fn,
        get_batch=_timed_get_batch(run),
        grad_sync=None if forward_only else run.engine, activation_meter=activation_meter,
        microbatch_group_size=run.cfg.parallel.microbatch_group_size_per_vp_stage,
        schedule=run.cfg.parallel.pipeline_schedule,
        delay_wgrad=run.cfg.parallel.delay_wgrad_compute,
        combined=run.cfg.parallel.overlap_moe_expert_parallel_comm)
    return [x / scale for x in losses]


def fp8_metrics(run: Run) -> dict[str, float] | None:
    """``--log-fp8-amax``: the chosen FP8 operands' amaxes, from every pipeline stage
    (collective over the world when more than one rank: every rank calls it)."""
    patterns = run.cfg.logging.log_fp8_amax
    if run.fp8 is None or not patterns:
        return None
    mine = run.fp8.amaxes(patterns)
    if run.topo.world_size > 1:
        import torch.distributed as dist

        parts: list[dict[str, float] | None] = [None] * run.topo.world_size
        dist.all_gather_object(parts, mine)
        for part in parts:
            mine.update(part or {})
    return {f"fp8-amax/{k}": v for k, v in sorted(mine.items())}


def moe_metrics(run: Run, iterations: int) -> dict[str, float] | None:
    """The routers' scalars of the log interval, and the multi-token-prediction depths'
    ``mtp_k loss`` (collective: every rank calls it)."""
    m = run.cfg.model
    moe, mtp = m.moe, m.mtp_num_layers or 0
    out: dict[str, float] = {}
    if moe.enabled:
        from megazero.moe.metrics import collect

        assert moe.num_experts is not None
        out.update(collect(run.chunks, run.topo, m.num_layers + mtp, moe.num_experts,
                           iterations, moe.moe_per_layer_logging))
    if mtp:
        from megazero.model import mtp as mtp_module

        out.update(mtp_module.collect(run.chunks, run.topo, mtp))
    return out or None


def _timed_get_batch(run: Run) -> Callable[[Iterator[dict[str, Any]]], dict[str, torch.Tensor]]:
    draw = functools.partial(get_batch, device=run.env.device, eod_mask=run.eod_mask,
                             cp=(run.topo.cp_rank, run.topo.cp_size),
                             mtp_layers=run.cfg.model.mtp_num_layers or 0,
                             documents=(run.eod_id, run.cfg.data.reset_position_ids,
                                        run.cfg.data.reset_attention_mask))

    def fetch(data_iterator: Iterator[dict[str, Any]]) -> dict[str, torch.Tensor]:
        try:
            return draw(data_iterator)
        except StopIteration:  # every rank draws alike, so every rank says it alike
            raise DataError(
                f"the training data ran out at iteration {run.state.iteration + 1} after "
                f"{run.state.consumed_samples} samples: the dataset was built for "
                f"--train-iters {run.batching.train_iters} x global batch "
                f"{run.batching.global_batch_size}; check --global-batch-size and "
                f"--train-iters against the checkpoint's") from None

    if not run.timers.enabled:
        return fetch

    def timed(data_iterator: Iterator[dict[str, Any]]) -> dict[str, torch.Tensor]:
        with run.timers.region("data"):
            return fetch(data_iterator)

    return timed


def _dp_mean(values: list[float], topo: ParallelTopology, device: torch.device) -> float:
    t = torch.tensor([sum(values), float(len(values))], dtype=torch.float64, device=device)
    if topo.dp_size > 1:
        dist.all_reduce(t, group=topo.dp_group)
    return (t[0] / t[1]).item()


def train_step(run: Run, data_iter: Iterator[dict[str, Any]],
               exit_votes: Callable[[], list[float]] = lambda: []
               ) -> tuple[float, Any, list[float]]:
    """One iteration; returns (global mean loss, StepResult, this rank's ``exit_votes()``
    (taken before the update) summed over every rank). The loss and the votes ride in the
    optimizer step's one scalar all-reduce: besides gradient and parameter traffic an
    iteration makes a single blocking collective. Its ``wall_clock_breakdown`` regions stay
    in ``run.timers`` until the loop reads them at a logged iteration (on GPUs resolving
    their events is a wait for the device: once per log line, not per iteration)."""
    t, it = run.timers, run.state.iteration + 1
    mem = None
    if run.cfg.logging.log_memory_phases:
        from megazero.observability.memory_phases import MemoryPhases

        mem = MemoryPhases(run.engine, run.env.device)
    per_token = run.cfg.train.calculate_per_token_loss
    token_sums: list[tuple[float, float]] | None = [] if per_token else None
    with t.region("backward"), run.phase(f"iteration {it}: forward-backward (pipeline "
                                         "schedule)", "mp"):
        losses = _schedule(run, data_iter, forward_only=False,
                           activation_meter=mem.meter if mem is not None else None,
                           num_microbatches=run.batching.microbatches_at(
                               run.state.consumed_samples), token_sums=token_sums)
    with t.region("grad sync (local)"), run.phase(f"iteration {it}: gradient sync", "dp"):
        run.engine.finish_grad_sync()
    if mem is not None:
        mem.after_backward()
    finite = all(math.isfinite(x) for x in losses)
    own = _token_sums(token_sums, run.topo) if token_sums is not None else _loss_sums(
        losses, run.topo)
    votes = exit_votes()
    if run.saver is not None:  # a save in flight: its copies are taken before the update
        run.saver.freeze()
    with t.region("optimizer"), run.phase(f"iteration {it}: optimizer step (non-finite "
                                          "check, grad norm, loss and exit votes)", "world"):
        result = run.engine.step(loss_is_finite=finite,
                                 skip_nonfinite=run.cfg.train.check_for_nan_in_loss_and_grad,
                                 also_sum=[*own, *votes],
                                 divide_grads_by=1 if per_token else None)
    if mem is not None:
        run.monitor.record_memory(mem.after_step())
    if run.fp8 is not None:  # delayed scaling: this step's amaxes join the history
        for line in run.fp8.finish_step():
            run.monitor.info(f"warning: iteration {it}: {line}")
    with t.region("scheduler"):
        if result.updated:  # the tokens consumed once this iteration's batch is counted
            consumed = run.state.consumed_samples + run.batching.global_batch_at(
                run.state.consumed_samples)
            run.scheduler.step(tokens=consumed * run.cfg.model.seq_length)
    if run.cfg.model.moe.enabled:
        from megazero.moe.router import update_expert_biases

        update_expert_biases(run.chunks, run.topo, apply=result.updated)
    loss_sum, count, *summed_votes = result.sums
    return loss_sum / count, result, summed_votes


def _loss_sums(losses: list[float], topo: ParallelTopology) -> tuple[float, float]:
    """This rank's part of the global mean loss: (sum, count) of its micro-batch losses. Every
    tp x pp rank of a data-parallel replica holds the replica's losses (the executor hands them
    to every pipeline stage), so only its tp 0, pp 0 rank counts them. They are summed over
    every rank inside the optimizer step's scalar all-reduce, with the exit votes."""
    owner = topo.tp_rank == 0 and topo.pp_rank == 0 and topo.cp_rank == 0
    return (sum(losses), float(len(losses))) if owner else (0.0, 0.0)


def _token_sums(sums: list[tuple[float, float]], topo: ParallelTopology
                ) -> tuple[float, float]:
    """``--calculate-per-token-loss``: this rank's (loss sum, token count) of the global batch.
    The last pipeline stage's TP rank 0 of each replica holds them (every CP rank its share of
    the tokens); summed over every rank they are the global batch's."""
    owner = topo.tp_rank == 0 and bool(sums)  # the rank holding the loss (rank 0 in a V)
    return (sum(a for a, _ in sums), sum(b for _, b in sums)) if owner else (0.0, 0.0)


def time_forwards(chunks: list[torch.nn.Module], timers: Timers) -> None:
    for c in chunks:
        c.register_forward_pre_hook(lambda *_: timers.start("forward"))
        c.register_forward_hook(lambda *_: timers.stop("forward"))


def evaluate(run: Run) -> float | None:
    """Mean validation loss over ``--eval-iters`` global batches, forward only. The validation
    iterator restarts at its first sample each time, so evaluations are comparable."""
    if run.valid_ds is None or run.cfg.train.eval_iters <= 0:
        return None
    for c in run.chunks:
        c.eval()
    it = batch_iterator(run.valid_ds, run.batching, run.topo, 0, cyclic=True)
    losses: list[float] = []
    sums: list[tuple[float, float]] | None = (
        [] if run.cfg.train.calculate_per_token_loss else None)
    with torch.no_grad():
        for _ in range(run.cfg.train.eval_iters):
            losses += _schedule(run, it, forward_only=True, token_sums=sums)
    for c in run.chunks:
        c.train()
    if sums is not None:  # the validation tokens' mean (every rank reduces over the world)
        t = torch.tensor(_token_sums(sums, run.topo), dtype=torch.float64, device=run.env.device)
        if run.topo.world_size > 1:
            dist.all_reduce(t)
        return (t[0] / t[1].clamp(min=1.0)).item()
    return _dp_mean(losses, run.topo, run.env.device)
