"""Each rule about sizes in one function, called by everyone who needs it.

The config's validation (:func:`validate`), the topology, the pipeline partition and schedules,
the model, the training setup and the planner all call these instead of re-deriving a rule, so a
check and its message cannot drift apart between them. Every message names the flag, the numbers
and the fix. ``error`` lets a caller with its own exception type (the topology's
``TopologyError``) raise the same message as that type.

This module imports nothing but :mod:`megazero.errors` at module level (no torch).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megazero.errors import ConfigError

if TYPE_CHECKING:
    from megazero.config.schema import MegazeroConfig, ModelConfig


def check(cond: bool, message: str, error: type[Exception] = ConfigError) -> None:
    if not cond:
        raise error(message)


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (the valid sizes error messages suggest)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_world_size(world_size: int, tp: int, pp: int,
                     error: type[Exception] = ConfigError, cp: int = 1) -> int:
    """``world_size`` must be a multiple of tp x pp (x cp); returns the data-parallel size."""
    if cp > 1:
        return check_world_size_cp(world_size, tp, pp, cp, error)
    mp = tp * pp
    if world_size < 1 or world_size % mp:
        valid = [(t, p) for t in divisors(world_size) for p in divisors(world_size // t)]
        raise error(
            f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {mp} "
            f"(--tensor-model-parallel-size x --pipeline-model-parallel-size); launch a multiple "
            f"of {mp} processes or use a (tp, pp) pair valid for world_size={world_size}: {valid}")
    return world_size // mp


def check_world_size_cp(world_size: int, tp: int, pp: int, cp: int,
                        error: type[Exception] = ConfigError) -> int:
    """With context parallelism the world is tp x cp x dp x pp; returns dp."""
    grid = tp * cp * pp
    if world_size < 1 or world_size % grid:
        raise error(
            f"world size {world_size} is not divisible by tp*cp*pp = {tp}*{cp}*{pp} = {grid} "
            f"(--tensor-model-parallel-size x --context-parallel-size x "
            f"--pipeline-model-parallel-size); launch a multiple of {grid} processes or use a "
            f"--context-parallel-size in {divisors(world_size // tp // pp or 1)}")
    return world_size // grid


def check_expert_grid(world_size: int, ep: int, etp: int, pp: int,
                      error: type[Exception] = ConfigError) -> int:
    """The expert grid ``etp x ep x edp x pp`` must tile the world; returns edp."""
    grid = ep * etp * pp
    if world_size % grid:
        fits = [d for d in divisors(world_size // pp) if (world_size // pp) % (d * etp) == 0] \
            if world_size % pp == 0 else []
        raise error(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} x "
            f"--pipeline-model-parallel-size {pp} = {grid} does not divide the world size "
            f"{world_size}; use an expert-parallel size from {fits}")
    return world_size // grid


def check_vpp_needs_pp(pp: int, vpp: int | None, flag: str | None = None,
                       error: type[Exception] = ConfigError) -> None:
    """Interleaving (more than one virtual chunk per stage) needs pipeline parallelism.
    ``flag``: what the caller's user typed to ask for it (default: ``vpp=N``)."""
    if pp == 1 and vpp is not None and (flag is not None or vpp > 1):
        asked = flag or f"vpp={vpp} (virtual pipeline chunks)"
        raise error(f"{asked} needs pipeline parallelism: it needs pp > 1, i.e. it needs "
                    f"--pipeline-model-parallel-size > 1, but pp=1; drop it or use more pipeline "
                    f"stages (with pp=1: vpp=None or 1)")


def pipeline_chunks(num_layers: int, pp: int, layers_per_virtual_stage: int | None) -> int:
    """Layers over pp stages and virtual chunks of ``layers_per_virtual_stage`` layers: checks
    both divisions and returns the chunks per stage (vpp; 1 without interleaving)."""
    check(num_layers >= 1 and pp >= 1,
          f"--num-layers ({num_layers}) and --pipeline-model-parallel-size ({pp}) must be >= 1")
    check(num_layers % pp == 0,
          f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
          f"valid pipeline sizes for {num_layers} layers: {divisors(num_layers)} (or use a "
          f"multiple of {pp} layers)")
    per_stage = num_layers // pp
    n = layers_per_virtual_stage
    if n is None:
        return 1
    check(n >= 1, f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {n}")
    check(per_stage % n == 0,
          f"--num-layers-per-virtual-pipeline-stage {n} does not divide the {per_stage} layers "
          f"per pipeline stage (--num-layers {num_layers} / pp {pp}; --num-layers must be a "
          f"multiple of pp x layers-per-virtual-stage = {pp * n}); valid values: "
          f"{divisors(per_stage)}")
    return per_stage // n


def sequence_parallel_active(sequence_parallel: bool, tp: int) -> bool:
    """Sequence parallelism is a mode of the TP group: it does something only when tp > 1."""
    return bool(sequence_parallel) and tp > 1


def check_sequence_split(seq_length: int, tp: int, sequence_parallel: bool) -> None:
    """Under sequence parallelism each TP rank holds seq_length / tp positions."""
    if sequence_parallel_active(sequence_parallel, tp):
        check(seq_length % tp == 0,
              f"--seq-length {seq_length} is not divisible by --tensor-model-parallel-size "
              f"{tp}, which --sequence-parallel needs (the sequence is split across TP ranks); "
              f"use a multiple of {tp}")


def check_tensor_parallel_split(m: ModelConfig, tp: int, sequence_parallel: bool) -> None:
    """Can this model be split over ``tp`` ranks? One rule for the CLI config and for a model
    built directly from a :class:`ModelConfig`; every message names the numbers and the fix."""
    check(m.num_attention_heads % tp == 0,
          f"--num-attention-heads {m.num_attention_heads} is not divisible by "
          f"--tensor-model-parallel-size {tp}; use a TP size that divides the heads "
          f"({divisors(m.num_attention_heads)}) or a multiple of {tp} heads")
    check(m.query_groups % tp == 0,
          f"--num-query-groups {m.query_groups} is not divisible by --tensor-model-parallel-size "
          f"{tp}; each TP rank needs whole key/value groups: use a TP size in "
          f"{divisors(m.query_groups)} or a multiple of {tp} groups")
    check(m.ffn_size % tp == 0,
          f"--ffn-hidden-size {m.ffn_size} is not divisible by --tensor-model-parallel-size "
          f"{tp}; use a multiple of {tp}")
    check_sequence_split(m.seq_length, tp, sequence_parallel)


def check_context_parallel(m: ModelConfig, tp: int, cp: int, sequence_parallel: bool,
                           comm_type: str) -> None:
    """Can the sequence be split over ``cp`` ranks? Each message is one line with the fix."""
    if cp == 1:
        return
    check(m.seq_length % (2 * cp) == 0,
          f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size = "
          f"{2 * cp} (each CP rank holds two of 2*CP chunks); use a multiple of {2 * cp}")
    if sequence_parallel_active(sequence_parallel, tp):
        check((m.seq_length // cp) % tp == 0,
              f"--seq-length {m.seq_length} / --context-parallel-size {cp} = "
              f"{m.seq_length // cp} is not divisible by --tensor-model-parallel-size {tp}, which "
              f"--sequence-parallel needs; use a --seq-length that is a multiple of "
              f"{cp * math.lcm(2, tp)}")
    if comm_type == "a2a":
        heads, groups = m.num_attention_heads // tp, m.query_groups // tp
        check(heads % cp == 0 and groups % cp == 0,
              f"--cp-comm-type a2a splits the heads over --context-parallel-size {cp}, but each "
              f"TP rank has {heads} heads and {groups} query groups; use --cp-comm-type p2p or "
              f"a CP size dividing both ({[d for d in divisors(heads) if groups % d == 0]})")
    check(m.attention_dropout == 0,
          f"--attention-dropout {m.attention_dropout} with --context-parallel-size {cp}: "
          f"attention dropout is not supported with context parallelism; pass "
          f"--attention-dropout 0")


def num_microbatches(global_batch: int, micro_batch: int, dp: int, *,
                     micro_name: str = "train_micro_batch_size_per_gpu (--micro-batch-size)",
                     dp_name: str | None = None, error: type[Exception] = ConfigError) -> int:
    """Micro-batches per iteration: ``global_batch / (micro_batch x dp)``, which must divide.
    ``micro_name``/``dp_name`` say where the two factors came from (the JSON's
    ``gradient_accumulation_steps`` can stand in for the micro-batch)."""
    step = micro_batch * dp
    if global_batch % step:
        lower, upper = max(step, global_batch - global_batch % step), \
            global_batch - global_batch % step + step
        raise error(f"train_batch_size (--global-batch-size) {global_batch} is not divisible by "
                    f"{micro_name} {micro_batch} x {dp_name or f'data-parallel size {dp}'} = "
                    f"{step}; use a multiple of {step} (e.g. {lower} or {upper})")
    return global_batch // step


_GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


def valid_microbatch_group_sizes(pp: int, num_microbatches: int) -> list[int]:
    """Group sizes N the interleaved schedule accepts for M micro-batches on pp stages:
    ``pp <= N <= M`` and a last group (``M mod N``) that is empty or at least pp."""
    m = num_microbatches
    return [n for n in range(pp, m + 1) if m % n == 0 or m % n >= pp]


def check_microbatch_groups(pp: int, num_microbatches: int | None, group_size: int | None,
                            samples_per_microbatch: int | None = None) -> int:
    """The one rule for the interleaved schedule's micro-batch groups; returns the group size N
    (``group_size``, or pp when None). ``num_microbatches=None`` checks only what N alone can;
    ``samples_per_microbatch`` (micro-batch size x data-parallel size), when known, lets the
    messages name global batch sizes that work.

    Micro-batches go through each model chunk N at a time (Megatron's
    ``--microbatch-group-size-per-virtual-pipeline-stage``). N < pp leaves the ring of virtual
    stages short of work; a last group of 1..pp-1 micro-batches would need the first stage to
    receive an activation before the last stage has produced it.
    """
    n = pp if group_size is None else group_size
    where = f"{_GROUP_FLAG} {n}" if group_size is not None else f"the default group size pp={pp}"
    check(isinstance(n, int) and n >= pp,
          f"{_GROUP_FLAG} {n} is smaller than --pipeline-model-parallel-size {pp}: each model "
          f"chunk must see at least pp={pp} micro-batches in a row; use a value >= {pp} "
          f"(or leave it out: the default is pp)")
    if num_microbatches is None:
        return n
    m = num_microbatches
    per = samples_per_microbatch
    gbs = f"--global-batch-size {m * per}" if per else "--global-batch-size"
    count = (f"{m} (--global-batch-size / (--micro-batch-size x data-parallel size)"
             f"{f' = {m * per} / {per}' if per else ''})")
    check(m >= pp,
          f"the interleaved pipeline schedule (--num-layers-per-virtual-pipeline-stage) needs "
          f"at least --pipeline-model-parallel-size {pp} micro-batches per iteration, got "
          f"{count}; raise --global-batch-size to "
          f"{pp * per if per else f'{pp} micro-batches'} or more, or drop "
          f"--num-layers-per-virtual-pipeline-stage to use 1F1B")
    valid = ", ".join(map(str, valid_microbatch_group_sizes(pp, m)))
    check(n <= m,
          f"{_GROUP_FLAG} {n} is larger than the {count} micro-batches per iteration; use a "
          f"value from {pp} to {m} whose last group is empty or >= {pp}: {valid}")
    last = m % n
    fits = (f"{gbs} rounded to a multiple of {n * per} (e.g. {m // n * n * per} or "
            f"{(m // n + 1) * n * per})" if per else
            f"a number of micro-batches that is a multiple of {n}")
    check(last == 0 or last >= pp,
          f"{count} micro-batches in groups of {n} ({where}) leave a last group of {last}, "
          f"but the interleaved pipeline schedule needs the last group to be empty or at "
          f"least --pipeline-model-parallel-size {pp}; set {_GROUP_FLAG} to one of {valid}, "
          f"or use {fits}")
    return n


def rampup_batch_size(rampup: tuple[int, int, int], global_batch: int, consumed: int) -> int:
    """Megatron's batch-size ramp-up: the global batch after ``consumed`` samples. It starts at
    START and grows by INCREMENT once every ``SAMPLES / ((global - START) / INCREMENT)``
    samples, reaching ``global_batch`` after SAMPLES samples."""
    start, increment, samples = rampup
    steps = (global_batch - start) // increment
    if steps <= 0 or samples <= 0:
        return global_batch
    per_step = samples / steps
    return min(global_batch, start + int(consumed / per_step) * increment)


def check_rampup(rampup: tuple[int, int, int], global_batch: int, micro_batch: int,
                 dp: int | None) -> list[int]:
    """The global batch sizes a ramp-up runs through (each a whole number of micro-batches
    on every data-parallel rank); raises naming the value that does not fit."""
    start, increment, samples = rampup
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    check(start > 0 and increment > 0 and samples >= 0,
          f"{flag}: START and INCREMENT must be > 0 and SAMPLES >= 0")
    check(start <= global_batch and (global_batch - start) % increment == 0,
          f"{flag}: the ramp must reach --global-batch-size {global_batch} in whole "
          f"increments from START (global - START = {global_batch - start} is not a "
          f"multiple of {increment})")
    sizes = list(range(start, global_batch + 1, increment))
    if dp is not None:
        step = micro_batch * dp
        bad = [g for g in sizes if g % step]
        check(not bad, f"{flag}: global batch {bad[0] if bad else 0} of the ramp is not a "
              f"multiple of --micro-batch-size {micro_batch} x data-parallel size {dp} = {step}; "
              f"make START and INCREMENT multiples of {step}")
    return sizes


def check_moe_layout(cfg: MegazeroConfig) -> None:
    """MoE against the parallel layout: experts split evenly over the expert-parallel ranks,
    expert parallelism only with experts, tensor parallelism only with sequence parallelism
    (each TP rank then routes its own tokens; without SP they would be routed twice)."""
    moe, p = cfg.model.moe, cfg.parallel
    ep = p.expert_model_parallel_size
    if moe.num_experts is None:
        # with --use-checkpoint-args the experts may come from the checkpoint: the layout is
        # checked again once its model settings are in (megazero.resume_checks)
        etp = p.expert_tensor_parallel_size
        check(ep * etp == 1 or cfg.checkpoint.use_checkpoint_args,
              f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} needs a "
              "Mixture-of-Experts model; add --num-experts E (or --use-checkpoint-args with "
              "--load of an MoE checkpoint) or drop the flags")
        return
    check(moe.num_experts % ep == 0,
          f"--num-experts {moe.num_experts} is not divisible by --expert-model-parallel-size "
          f"{ep}; use an expert-parallel size from "
          f"{[d for d in divisors(moe.num_experts) if p.world_size % (d * p.pp) == 0]}"
          if p.world_size is not None else f"{divisors(moe.num_experts)}")
    check(p.tp == 1 or p.sequence_parallel,
          f"--num-experts with --tensor-model-parallel-size {p.tp} needs --sequence-parallel "
          "(each TP rank routes its own slice of the tokens); add --sequence-parallel")
    etp = p.expert_tensor_parallel_size
    ffn = moe.moe_ffn_hidden_size or cfg.model.ffn_size
    check(ffn % etp == 0,
          f"--moe-ffn-hidden-size {ffn} is not divisible by --expert-tensor-parallel-size "
          f"{etp} (each rank holds 1/{etp} of every expert's hidden units); use a size from "
          f"{[d for d in divisors(ffn) if d <= 64]} or another hidden size")
    lamb = cfg.optimizer.optimizer in ("lamb", "onebitlamb")
    check(not lamb or ep * etp == 1,
          f"optimizer {cfg.optimizer.optimizer} (optimizer.type) with "
          f"--expert-model-parallel-size {ep} x "
          f"--expert-tensor-parallel-size {etp}: Lamb's whole-parameter norms are not summed "
          "over the expert groups; use adam/adamw, or expert-parallel sizes 1")
    freq = moe.moe_layer_freq
    check(isinstance(freq, int) or len(freq) == cfg.model.num_layers,
          f"--moe-layer-freq lists {0 if isinstance(freq, int) else len(freq)} layers but "
          f"--num-layers is {cfg.model.num_layers}; give one 0/1 per layer")


def validate(cfg: MegazeroConfig) -> None:
    """Checks that involve more than one sub-config; each message names the numbers and the fix."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, pp = p.tp, p.pp
    check_tensor_parallel_split(m, tp, p.sequence_parallel)
    check_context_parallel(m, tp, p.cp, p.sequence_parallel, p.cp_comm_type)
    check_moe_layout(cfg)
    per_chunk = p.num_layers_per_virtual_pipeline_stage
    pipeline_chunks(m.num_layers, pp, per_chunk)
    if per_chunk is not None:
        count = step = None
        if p.world_size is not None and t.global_batch_size is not None:
            step = t.micro_batch_size * p.dp
            if step > 0 and t.global_batch_size % step == 0:
                count = t.global_batch_size // step
        check_microbatch_groups(pp, count, p.microbatch_group_size_per_vp_stage, step)
        if t.rampup_batch_size is not None and step and count is not None:
            for g in check_rampup(t.rampup_batch_size, t.global_batch_size or step,
                                  t.micro_batch_size, p.dp):
                check_microbatch_groups(pp, g // step, p.microbatch_group_size_per_vp_stage,
                                        step)
    if t.rampup_batch_size is not None:
        check(t.global_batch_size is not None, "--rampup-batch-size needs --global-batch-size "
              "(the size the ramp reaches)")
        check_rampup(t.rampup_batch_size, t.global_batch_size or 0, t.micro_batch_size,
                     p.dp if p.world_size is not None else None)
    check(t.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0, got "
          f"{t.manual_gc_interval}")
    check(t.max_nonfinite_steps >= 1, f"--max-nonfinite-steps must be >= 1 (non-finite "
          f"steps in a row before the run stops), got {t.max_nonfinite_steps}")
    check(t.spike_factor == 0 or t.spike_factor > 1, f"--spike-factor must be 0 (off) or > 1 "
          f"(how many times the recent median a spike is), got {t.spike_factor}")
    check(t.spike_window >= 1, f"--spike-window must be >= 1 (sound steps the spike check "
          f"takes the median over), got {t.spike_window}")
    lg = cfg.logging
    if lg.comms_logger:
        from megazero.comms_logging import CommsLoggerSettings  # torch only when asked for
        CommsLoggerSettings.from_block(lg.comms_logger)
    if lg.flops_profiler:
        from megazero.flops_profiler import FlopsProfilerSettings
        FlopsProfilerSettings.from_block(lg.flops_profiler)
    if lg.profile:
        check(1 <= lg.profile_step_start < lg.profile_step_end, f"--profile-step-start "
              f"{lg.profile_step_start} and --profile-step-end {lg.profile_step_end}: profiling "
              f"covers iterations [start, end), so give 1 <= start < end")
    check(p.distributed_timeout_minutes > 0, f"--distributed-timeout-minutes must be > 0, got "
          f"{p.distributed_timeout_minutes}")
    check(t.micro_batch_size >= 1, f"--micro-batch-size (train_micro_batch_size_per_gpu) must "
          f"be >= 1, got {t.micro_batch_size}")
    check(t.train_iters is None or t.train_samples is None,
          f"--train-iters {t.train_iters} and --train-samples {t.train_samples} are both given; "
          f"give only one of them")
    o = cfg.optimizer
    for flag, value, ok in (
            ("--lr (optimizer.params.lr)", o.lr, o.lr >= 0),
            ("--min-lr", o.min_lr, o.min_lr >= 0),
            ("--adam-beta1 (optimizer.params.betas[0])", o.adam_beta1, 0 <= o.adam_beta1 < 1),
            ("--adam-beta2 (optimizer.params.betas[1])", o.adam_beta2, 0 <= o.adam_beta2 < 1),
            ("--adam-eps (optimizer.params.eps)", o.adam_eps, o.adam_eps >= 0),
            ("--weight-decay (optimizer.params.weight_decay)", o.weight_decay, o.weight_decay >= 0),
            ("--clip-grad (gradient_clipping)", o.clip_grad, o.clip_grad >= 0),
            ("--lr-warmup-iters (scheduler.params.warmup_num_steps)", o.lr_warmup_iters,
             o.lr_warmup_iters >= 0)):
        check(ok, f"{flag}: got {value}, expected a value >= 0 (betas: 0 <= beta < 1)")
    onebit = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam",
              "onebitlamb": "OneBitLamb"}.get(o.optimizer)
    if onebit:  # DeepSpeed: "1bit-Adam is not compatible with ZeRO", and so 0/1 Adam
        check(cfg.zero.stage == 0, f"optimizer.type {onebit} runs without ZeRO, as "
              f"DeepSpeed's: set zero_optimization.stage 0 (--zero-stage 0), or use Adam, AdamW "
              f"or Lamb at stage {cfg.zero.stage}")
        for name in ("freeze_step", "var_freeze_step", "var_update_scaler",
                     "local_step_scaler", "local_step_clipper"):
            check(getattr(o, name) >= 1, f"optimizer.params.{name}: got {getattr(o, name)}, "
                  "expected >= 1")
    gas = t.gradient_accumulation_steps
    if p.world_size is not None and t.global_batch_size is not None and gas is not None:
        dp = p.dp
        want = t.micro_batch_size * gas * dp
        check(t.global_batch_size == want,
              f"batch sizes do not add up: train_batch_size {t.global_batch_size} != "
              f"train_micro_batch_size_per_gpu {t.micro_batch_size} x "
              f"gradient_accumulation_steps {gas} x dp_size {dp} = {want}; set "
              f"train_batch_size to {want}")
