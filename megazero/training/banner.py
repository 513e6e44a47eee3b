"""The start-up banner a training run prints once: the layout, the model's parameter count
(the same at every layout), the batch, the attention kernel the run gets, MoE, offload, data
and where logs and checkpoints go."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from megazero.distributed.topology import ParallelTopology
from megazero.fusions.describe import describe_fusions
from megazero.model.attention_probe import describe_attention
from megazero.tensor_parallel.utils import is_duplicate_copy


def local_parameter_share(chunks: list[torch.nn.Module], topo: ParallelTopology,
                          shapes: dict[int, torch.Size] | None = None,
                          experts_only: bool = False) -> float:
    """This rank's share of the model's parameter count; summed over every rank and divided by
    the dense replicas (dp x cp) it is the count of the model itself, the same at every layout
    (MoE experts, replicated over their expert-data-parallel group instead, weighed to match).

    Copies that duplicate another rank's (:func:`~megazero.tensor_parallel.utils.
    is_duplicate_copy`: a tensor every TP rank holds whole counts on TP rank 0, the last stage's
    copy of a tied word embedding not at all) are skipped; a TP-split tensor counts its slice;
    vocabulary pad rows (the vocabulary is padded to a multiple of
    ``make_vocab_size_divisible_by x tp``) are not parameters of the model.
    ``shapes`` (``id(param)`` -> TP-shard shape) counts the parameters ZeRO-3 has partitioned
    (their ``.data`` holds a data-parallel partition, or nothing) at their full size.
    """
    share = 0.0
    for c in chunks:
        for p in c.parameters():
            if is_duplicate_copy(p, topo.tp_rank):
                continue
            if experts_only and not getattr(p, "expert", False):
                continue
            numel = math.prod(shapes[id(p)]) if shapes and id(p) in shapes else p.numel()
            # an MoE expert has edp replicas where a dense tensor has dp (x cp): weigh it so
            # that the sum over every rank, divided by the dense replicas, counts it once
            copies = topo.grad_size / topo.edp_size if getattr(p, "expert", False) else 1.0
            share += numel * copies * getattr(p, "vocab_size", 1) / getattr(
                p, "padded_vocab_size", 1)
    return share


def padded_vocab(chunks: list[torch.nn.Module]) -> int | None:
    for c in chunks:
        for p in c.parameters():
            if hasattr(p, "padded_vocab_size"):
                return int(p.padded_vocab_size)
    return None


def architecture(m: Any) -> str:
    """The model's shape beyond its sizes, as the flags set it (a :class:`ModelConfig`)."""
    groups = m.query_groups
    parts = [
        m.normalization,
        "RoPE" if m.position_embedding_type == "rope" else "learned positions",
        f"SwiGLU MLP {m.ffn_size}" if m.swiglu else f"GELU MLP {m.ffn_size}",
        f"{groups} query groups" if groups != m.num_attention_heads else "multi-head attention",
        f"head width {m.head_dim}",
        "biases" if m.add_bias_linear else ("QKV bias only" if m.add_qkv_bias else "no biases"),
    ]
    if m.qk_layernorm:
        parts.append("QK layernorm")
    parts.append("tied embeddings" if not m.untie_embeddings_and_output_weights
                 else "untied output layer")
    return ", ".join(parts)


def schedule_line(o: Any, train_iters: int) -> str:
    """The learning-rate schedule in one line (an :class:`OptimizerConfig`): Megatron's style
    with its warm-up and decay lengths, in iterations or tokens, and the decoupled rate."""
    if o.scheduler_type:
        return f"> learning rate: DeepSpeed scheduler {o.scheduler_type} {o.scheduler_params}"
    def iterations(n: int) -> str:
        return f"{n} iteration{'' if n == 1 else 's'}"

    warmup = (f"{o.lr_warmup_tokens:,} tokens" if o.lr_warmup_tokens is not None
              else iterations(o.lr_warmup_iters))
    decay = (f"{o.lr_decay_tokens:,} tokens" if o.lr_decay_tokens is not None
             else iterations(o.lr_decay_iters or train_iters))
    line = (f"> learning rate: {o.lr_decay_style} from {o.lr:g} to {o.min_lr:g}, warm-up "
            f"{warmup}" + (f", decay over {decay}" if o.lr_decay_style != "constant" else ""))
    if o.decoupled_lr is not None:
        low = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
        line += f"; embedding and output layer from {o.decoupled_lr:g} to {low:g}"
    return line


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for i in layers:
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def fp8_line(fp8: Any, num_layers: int, precision: str) -> str:
    """The banner's FP8 line: format, recipe, and which layers (global, 0-based) run FP8 GEMMs
    (this rank's pipeline stage; the bf16 ones are what --first-last-layers-bf16 kept)."""
    bf16 = sorted(set(range(num_layers)) - set(fp8.fp8_layers) - set(fp8.bf16_layers))
    kept = f"; bf16 GEMMs in layers {_ranges(fp8.bf16_layers)}" if fp8.bf16_layers else ""
    other = f" (layers {_ranges(bf16)} on other pipeline stages)" if bf16 else ""
    return (f"> fp8: {fp8.recipe.describe()}; FP8 GEMMs in the linears of layers "
            f"{_ranges(fp8.fp8_layers) or 'none'}{kept}{other}; embedding, output layer, "
            f"router, norms and attention in {precision}")


def describe_run(run: Any) -> None:
    """Print the run's start-up banner (rank 0): layout, model size, batch, attention kernel,
    MoE, offload, data, sinks. Collective: every rank counts its parameter share."""
    cfg, topo, b = run.cfg, run.topo, run.batching
    shapes: dict[int, torch.Size] = {}
    for store in run.engine.stores:  # ZeRO-3 keeps each parameter's full (TP-shard) shape
        shapes.update(store.param_shapes())
    counts = torch.tensor([local_parameter_share(run.chunks, topo, shapes),
                           local_parameter_share(run.chunks, topo, shapes, experts_only=True)],
                          dtype=torch.float64, device=run.env.device)
    if topo.world_size > 1:
        dist.all_reduce(counts)
    # dp (x cp) replicas hold the same shards
    total, experts = (round(v / topo.grad_size) for v in counts.tolist())
    padded = padded_vocab(run.chunks)
    vocab = f"vocab {cfg.model.vocab_size}" + (
        f" (padded to {padded} for --make-vocab-size-divisible-by "
        f"{cfg.model.make_vocab_size_divisible_by} x tp {topo.tp_size})"
        if padded and padded != cfg.model.vocab_size else "")
    precision = "fp16" if cfg.precision.fp16 else "bf16" if cfg.precision.bf16 else "fp32"
    moe = cfg.model.moe
    active = ""
    if moe.enabled and experts:  # every token passes top-k of each MoE layer's experts
        used = total - experts + experts * moe.moe_router_topk // moe.num_experts
        active = f", {used / 1e6:.2f}M active per token ({used:,}, top-{moe.moe_router_topk})"
    cp = f"cp {topo.cp_size} x " if topo.cp_size > 1 else ""
    lines = [
        f"> world {topo.world_size} ({run.env.backend}): tp {topo.tp_size} x {cp}pp "
        f"{topo.pp_size} x dp {topo.dp_size}, vpp {topo.vpp_size or 1}, sequence parallel "
        f"{run.sp}, ZeRO stage {cfg.zero.stage}, {precision}"
        + (f", context parallel {cfg.parallel.cp_comm_type}" if topo.cp_size > 1 else ""),
        f"> model: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, heads "
        f"{cfg.model.num_attention_heads}, seq {cfg.model.seq_length}, {vocab}: "
        f"{total / 1e6:.2f}M parameters ({total:,}){active}",
        f"> architecture: {architecture(cfg.model)}",
        f"> batch: global {b.global_batch_size} = micro {b.micro_batch_size} x "
        f"{b.num_microbatches} micro-batches x dp {topo.dp_size}; {b.train_iters} iterations"
        + (f" or {b.train_tokens:,} tokens (--train-tokens), whichever comes first"
           if b.train_tokens is not None else ""),
        schedule_line(cfg.optimizer, b.train_iters),
    ]
    if not dist.is_initialized() or dist.get_rank() == 0:  # the probe runs where it prints
        m = cfg.model
        dtype = (torch.float16 if cfg.precision.fp16 else torch.bfloat16 if cfg.precision.bf16
                 else torch.float32)
        lines.append("> attention: " + describe_attention(
            "auto", m.use_flash_attn, run.env.device, dtype,
            max(1, m.num_attention_heads // topo.tp_size), max(1, m.query_groups // topo.tp_size),
            m.head_dim, m.attention_dropout))
    lines.append("> fusions: " + describe_fusions(cfg.model, run.env.device))
    if run.fp8 is not None:
        lines.append(fp8_line(run.fp8, cfg.model.num_layers, precision))
    if moe.enabled:
        lines.append(f"> moe: {moe.num_experts} experts, top-{moe.moe_router_topk} "
                     f"({moe.moe_router_load_balancing_type}), expert parallel "
                     f"{cfg.parallel.expert_model_parallel_size}, "
                     f"{moe.moe_token_dispatcher_type} dispatcher"
                     + (f", capacity factor {moe.moe_expert_capacity_factor}"
                        if moe.moe_expert_capacity_factor is not None else ", dropless"))
    for what, off in (("optimizer", cfg.zero.offload_optimizer),
                      ("param", cfg.zero.offload_param)):
        if off.enabled:
            where = f"NVMe files under {off.nvme_path}" if off.nvme else "host memory"
            held = ("fp32 masters and optimizer moments; the step runs on the CPU"
                    if what == "optimizer" else "ZeRO-3 parameter shards between uses")
            lines.append(f"> offload_{what}: {held}, in {where} (pin_memory "
                         f"{str(off.pin_memory).lower()})")
    if b.rampup is not None:
        start, inc, samples = b.rampup
        lines.append(f"> batch ramp-up: global batch {start} growing by {inc} over the first "
                     f"{samples:,} samples to {b.global_batch_size}")
    d = cfg.data
    if d.mock_data:
        lines.append("> data: --mock-data (random tokens)")
    else:
        where = " ".join(d.data_path) if not d.per_split_paths else "; ".join(
            f"{name} {' '.join(paths)}" for name, paths in (
                ("train", d.train_data_path), ("valid", d.valid_data_path),
                ("test", d.test_data_path)) if paths)
        lines.append(f"> data: {where} ({d.tokenizer_type}"
                     + (f" {d.tokenizer_model}" if d.tokenizer_model else "")
                     + (", .bin files read, not mapped" if not d.mmap_bin_files else "") + ")")
    if cfg.logging.tensorboard_dir:
        lines.append(f"> tensorboard: writing to {cfg.logging.tensorboard_dir}")
    if cfg.checkpoint.save:
        every = (f"every {cfg.checkpoint.save_interval} iterations and "
                 if cfg.checkpoint.save_interval else "")
        lines.append(f"> checkpoints: saving to {cfg.checkpoint.save} {every}at the end of "
                     f"training")
    run.monitor.info("\n".join(lines))
