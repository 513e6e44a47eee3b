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

from megazero.errors import ConfigError


def check(cond: bool, message: str, error: type[Exception] = ConfigError) -> None:
    if not cond:
        raise error(message)


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (the valid sizes error messages suggest);
    pairs up to the square root, so a width of 14336 costs 120 steps, not 14336."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n > 0 else []
    return small + [n // d for d in reversed(small) if d * d != n]


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


def examples(*values: int) -> str:
    """``e.g. 8 or 16`` from the positive candidates, each once (``e.g. 8`` when they agree)."""
    shown = sorted({v for v in values if v > 0})
    return "e.g. " + " or ".join(map(str, shown))


def num_microbatches(global_batch: int, micro_batch: int, dp: int, *,
                     micro_name: str = "train_micro_batch_size_per_gpu (--micro-batch-size)",
                     dp_name: str | None = None, error: type[Exception] = ConfigError) -> int:
    """Micro-batches per iteration: ``global_batch / (micro_batch x dp)``, which must divide.
    ``micro_name``/``dp_name`` say where the two factors came from (the JSON's
    ``gradient_accumulation_steps`` can stand in for the micro-batch)."""
    step = micro_batch * dp
    if global_batch % step:
        down = global_batch - global_batch % step
        raise error(f"train_batch_size (--global-batch-size) {global_batch} is not divisible by "
                    f"{micro_name} {micro_batch} x {dp_name or f'data-parallel size {dp}'} = "
                    f"{step}; use a multiple of {step} ({examples(down, down + step)})")
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
    fits = (f"{gbs} rounded to a multiple of {n * per} "
            f"({examples(m // n * n * per, (m // n + 1) * n * per)})" if per else
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


#: ``--pipeline-schedule`` names; the V ones place two chunks per rank in a V.
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")


def schedule_min_microbatches(schedule: str | None, pp: int) -> int:
    """DualPipeV's order needs ``2 pp`` micro-batches per step (as DeepSeek's); others any."""
    return 2 * pp if schedule == "dualpipev" else 1


def check_pipeline_schedule(schedule: str | None, pp: int, layers_per_virtual_stage: int | None,
                            num_layers: int, delay_wgrad: bool,
                            num_microbatches: int | None,
                            error: type[Exception] = ConfigError) -> None:
    """``--pipeline-schedule`` and ``--delay-wgrad-compute`` against the layout, in one line."""
    flag = f"--pipeline-schedule {schedule}"
    if schedule in ("zb-h1",) + V_SCHEDULES:
        check(pp > 1, f"{flag} needs --pipeline-model-parallel-size > 1 (got {pp}); drop it "
              f"at pp 1", error)
    if schedule in V_SCHEDULES:
        check(layers_per_virtual_stage is None, f"{flag} places its own two chunks per rank "
              f"in a V; drop --num-layers-per-virtual-pipeline-stage "
              f"{layers_per_virtual_stage}", error)
        check(num_layers % (2 * pp) == 0, f"{flag} cuts --num-layers {num_layers} into "
              f"2 x pp = {2 * pp} equal chunks; use a multiple of {2 * pp} layers", error)
    if schedule == "zb-h1":
        check(layers_per_virtual_stage is None, f"{flag} runs one chunk per rank; drop "
              f"--num-layers-per-virtual-pipeline-stage or use zbv", error)
    if schedule == "interleaved":
        check(layers_per_virtual_stage is not None, f"{flag} needs "
              f"--num-layers-per-virtual-pipeline-stage (the layers of each chunk)", error)
    if schedule == "1f1b":
        check(layers_per_virtual_stage is None, f"{flag} runs one chunk per rank; with "
              f"--num-layers-per-virtual-pipeline-stage write --pipeline-schedule "
              f"interleaved", error)
    if delay_wgrad:
        check(schedule in (None, "1f1b") and layers_per_virtual_stage is None,
              f"--delay-wgrad-compute runs 1F1B with the weight gradients after each "
              f"backward's exchange; drop it with {flag if schedule else 'interleaving'} "
              f"(zb-h1, zbv and dualpipev defer them already)", error)
    low = schedule_min_microbatches(schedule, pp)
    if num_microbatches is not None and num_microbatches < low:
        raise error(f"{flag} needs at least 2 x pp = {low} micro-batches per step but "
                    f"--global-batch-size gives {num_microbatches}; raise it to {low} x "
                    f"--micro-batch-size x data-parallel size, or use zbv")


def _expand_layout(text: str) -> str:
    """Megatron's layout shorthand: ``x*n`` repeats one symbol, ``(...)*n`` a group."""
    import re

    group = re.compile(r"\(([^()]*)\)\*(\d+)")
    while True:
        new = group.sub(lambda mt: mt.group(1) * int(mt.group(2)), text)
        if new == text:
            break
        text = new
    return re.sub(r"([EtL])\*(\d+)", lambda mt: mt.group(1) * int(mt.group(2)), text)


def parse_pipeline_layout(layout: str, num_layers: int) -> list[tuple[int, bool, bool]]:
    """``--pipeline-model-parallel-layout`` (Megatron's): virtual stages separated by ``|``,
    ``E`` the embedding, ``t`` a transformer layer, ``L`` the loss (output layer), with the
    shorthands ``t*3`` and ``(tt|)*2``; spaces and commas ignored. Returns per virtual stage
    ``(layers, embedding, loss)``; the embedding must open the first stage and the loss close
    the last, and the ``t`` must add up to ``--num-layers``."""
    flag = f"--pipeline-model-parallel-layout {layout!r}"
    text = _expand_layout(layout.replace(" ", "").replace(",", ""))
    bad = sorted(set(text) - set("EtL|"))
    check(not bad, f"{flag}: unknown symbols {bad}; write stages of E (embedding), t "
          f"(transformer layer) and L (loss) separated by |, e.g. 'Et*3|t*4|t*3L'")
    stages = [(s.count("t"), "E" in s, "L" in s) for s in text.split("|")]
    check(text.count("E") == 1 and text.split("|")[0].startswith("E"), f"{flag}: the "
          f"embedding E must open the first stage, once", ConfigError)
    check(text.count("L") == 1 and text.split("|")[-1].endswith("L"), f"{flag}: the loss L "
          f"must close the last stage, once")
    total = sum(n for n, _, _ in stages)
    check(total == num_layers, f"{flag} places {total} transformer layers but --num-layers is "
          f"{num_layers}; make the t add up to {num_layers}")
    return stages


def stage_layer_counts(num_layers: int, stages: int, first: int | None = None,
                       last: int | None = None, account_embedding: bool = False,
                       account_loss: bool = False, layout: str | None = None) -> list[int]:
    """Transformer layers of each virtual stage (in stage order) for Megatron's uneven-split
    flags: ``--pipeline-model-parallel-layout``, or ``--decoder-first-pipeline-num-layers``
    and ``--decoder-last-pipeline-num-layers`` (the first and last virtual stage; the rest
    split evenly over the others), or ``--account-for-embedding-in-pipeline-split`` and
    ``--account-for-loss-in-pipeline-split`` (the embedding, the loss counted as one layer of
    the first, the last stage). Without any of them: ``num_layers / stages`` each."""
    if layout is not None:
        counts = [n for n, _, _ in parse_pipeline_layout(layout, num_layers)]
        check(len(counts) == stages, f"--pipeline-model-parallel-layout gives {len(counts)} "
              f"stages but the run has {stages} (pipeline stages x chunks per stage); give "
              f"{stages} stages separated by |")
        return counts
    if first is not None or last is not None:
        check(stages >= 2, "--decoder-first/last-pipeline-num-layers need pipeline parallelism")
        rest = num_layers - (first or 0) - (last or 0)
        middle = stages - (first is not None) - (last is not None)
        check(rest >= 0 and (middle == 0 and rest == 0 or middle > 0 and rest % middle == 0),
              f"--decoder-first-pipeline-num-layers {first} and "
              f"--decoder-last-pipeline-num-layers {last} leave {rest} of --num-layers "
              f"{num_layers} layers for {middle} other stages; make it a multiple of {middle}"
              if middle else f"--decoder-first-pipeline-num-layers {first} + "
              f"--decoder-last-pipeline-num-layers {last} must equal --num-layers "
              f"{num_layers} with two stages")
        per = rest // middle if middle else 0
        counts = [per] * stages
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts
    extra = int(account_embedding) + int(account_loss)
    total = num_layers + extra
    check(total % stages == 0, f"--num-layers {num_layers}"
          f"{' + 1 (embedding)' if account_embedding else ''}"
          f"{' + 1 (loss)' if account_loss else ''} = {total} does not split evenly over "
          f"{stages} pipeline stages; use a multiple of {stages}")
    per = total // stages
    counts = [per] * stages
    counts[0] -= int(account_embedding)
    counts[-1] -= int(account_loss)
    return counts
