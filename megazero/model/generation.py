"""Autoregressive text generation on a megazero :class:`~megazero.model.gpt.GPTModel`, with a
key/value cache.

The training forward recomputes every position each call; generating ``n`` tokens that way
costs ``O(n^2)`` layer passes. :func:`forward_with_cache` runs the same modules (the same
weights, norms, rotary tables and tensor-parallel linears, so tp > 1 works unchanged inside a
torchrun world) on the new positions only, keeping each layer's keys and values. The model must
be whole (no pipeline split: ``pre_process`` and ``post_process``) and is run in eval mode.

Sampling follows the usual order: temperature, then top-k, then top-p (nucleus), then a draw
from a seeded ``torch.Generator``; greedy decoding is ``argmax``. Under tensor parallelism every
TP rank holds the same gathered logits and draws with the same seed; the chosen token is
broadcast from TP rank 0 anyway, so the ranks can never diverge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.model.positional import apply_rotary
from megazero.tensor_parallel.mappings import gather_from_tensor_parallel_region


@dataclass(frozen=True)
class SamplingConfig:
    """``greedy`` ignores the rest. ``top_k`` 0 and ``top_p`` 1.0 disable those filters."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234

    def __post_init__(self) -> None:
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"--temperature {self.temperature}: must be > 0 (or use --greedy)")
        if self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k}: must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p {self.top_p}: must be in (0, 1] (1 disables it)")


class KVCache:
    """Per layer, this rank's keys and values ``[s, b, groups/t, head_dim]`` so far."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.layers:
            k0, v0 = self.layers[layer]
            k, v = torch.cat([k0, k]), torch.cat([v0, v])
        self.layers[layer] = (k, v)
        return k, v


def _check_whole(model) -> None:
    if not (model.pre_process and model.post_process):
        raise ValueError("generation needs the whole model on one pipeline stage; a checkpoint "
                         "saved at --pipeline-model-parallel-size > 1 loads whole with "
                         "tools/generate_text.py --load (or megazero.checkpoint."
                         "read_model_state + megazero.convert.load_global_state)")
    if model.sequence_parallel:
        raise ValueError("generation runs without --sequence-parallel; build the model with "
                         "parallel=ParallelContext(sequence_parallel=False)")


def _causal_from(offset: int, s: int, total: int, device: torch.device) -> torch.Tensor:
    """Query i (absolute position offset + i) sees keys 0..offset + i."""
    return (torch.arange(total, device=device)[None, :]
            <= torch.arange(offset, offset + s, device=device)[:, None])


def _latent_attention(attn, x, offset: int, cache: KVCache, layer: int, rotary) -> torch.Tensor:
    """:class:`~megazero.model.mla.MultiLatentAttention` given the cache, which keeps each
    position's normalised latent and rotated shared key (``kv_lora_rank + pe`` numbers, not
    the heads' keys and values): they are expanded to keys and values at every step."""
    q = attn.queries(x, rotary)
    c, k_pe = cache.append(layer, *attn.latent(x, rotary))
    k, v = attn.keys_values(c, k_pe)
    q, k, v = attn.padded(q, k, v)
    s, b = q.shape[:2]
    mask = _causal_from(offset, s, k.shape[0], x.device)
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    ctx = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
    return attn.linear_proj(attn.context(ctx.permute(2, 0, 1, 3).reshape(s, b, -1)))


def _attention(attn, x, offset: int, cache: KVCache, layer: int, rotary) -> torch.Tensor:
    """:class:`SelfAttention.forward` for positions ``offset..offset+s-1`` given the cache."""
    if hasattr(attn, "latent"):  # multi-latent attention
        return _latent_attention(attn, x, offset, cache, layer, rotary)
    qkv = attn.linear_qkv(x)
    s, b = qkv.shape[:2]
    per_group, d = attn.local_heads // attn.local_groups, attn.head_dim
    q, k, v = qkv.view(s, b, attn.local_groups, (per_group + 2) * d).split(
        [per_group * d, d, d], dim=-1)
    q, k = attn.normalize_qk(q.reshape(s, b, attn.local_heads, d), k)
    if rotary is not None:
        cos, sin = rotary
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = cache.append(layer, k, v)
    total = k.shape[0]
    # query i (absolute position offset + i) sees keys 0..offset + i
    mask = (torch.arange(total, device=x.device)[None, :]
            <= torch.arange(offset, offset + s, device=x.device)[:, None])
    if per_group > 1:  # each KV group serves its query heads (no enable_gqa: torch < 2.5)
        k, v = (t.repeat_interleave(per_group, dim=2) for t in (k, v))
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    ctx = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
    return attn.linear_proj(ctx.permute(2, 0, 1, 3).reshape(s, b, attn.local_heads * d))


@torch.no_grad()
def forward_with_cache(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` (unpadded, all TP shards gathered) for ``tokens [b, s]``, the
    continuation of the ``cache.length`` positions already in ``cache``."""
    _check_whole(model)
    offset, s = cache.length, tokens.shape[1]
    if offset + s > model.config.max_positions:
        raise ValueError(f"sequence of {offset + s} tokens exceeds the model's "
                         f"--max-position-embeddings {model.config.max_positions}")
    emb = model.embedding
    x = emb.word_embeddings(tokens)
    if emb.position_embeddings is not None:
        x = x + emb.position_embeddings.weight[offset:offset + s]
    x = x.transpose(0, 1)
    rotary = None
    if model.rotary is not None:
        cos, sin = model.rotary(offset + s, x.dtype)
        rotary = (cos[offset:], sin[offset:])
    for i, layer in model.decoder.layers.items():
        h = _attention(layer.self_attention, layer.input_layernorm(x), offset, cache, int(i),
                       rotary)
        x = x + h
        x = x + layer.mlp(layer.pre_mlp_layernorm(x))
    x = model.decoder.final_layernorm(x)
    cache.length = offset + s
    return _full_logits(model, model._logits(x))


def _full_logits(model, local: torch.Tensor) -> torch.Tensor:
    """``[s, b, V/t]`` vocab-parallel logits -> ``[b, s, vocab]`` on every TP rank."""
    full = gather_from_tensor_parallel_region(local, model.topo.tp_group)
    return full[..., :model.vocab_size].transpose(0, 1).float()


@torch.no_grad()
def forward_full(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` of the model's own (training) forward, for every position."""
    _check_whole(model)
    local = model(tokens)  # [b, s, V/t]
    return _full_logits(model, local.transpose(0, 1))


def sample(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None
           ) -> torch.Tensor:
    """Next token ids ``[b]`` from last-position logits ``[b, vocab]``."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / cfg.temperature
    if cfg.top_k > 0:
        kth = logits.topk(min(cfg.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first stays)
        drop = (probs.cumsum(dim=-1) - probs) >= cfg.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(model, prompt_ids: torch.Tensor | Sequence[int], max_new_tokens: int,
             sampling: SamplingConfig | None = None, eos_id: int | None = None,
             use_cache: bool = True) -> torch.Tensor:
    """Prompt ``[b, s]`` (or one list of ids) -> ``[b, s + n]`` with ``n <= max_new_tokens``.

    Stops early once every sequence has produced ``eos_id``; a finished sequence is padded with
    ``eos_id``. ``use_cache=False`` reruns the full forward each step (the reference the cache
    is tested against).
    """
    sampling = sampling or SamplingConfig()
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty; give at least one token")
    generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
    cache = KVCache()
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    step_input = ids
    try:
        for _ in range(max_new_tokens):
            if use_cache:
                logits = forward_with_cache(model, step_input, cache)[:, -1]
            else:
                logits = forward_full(model, ids)[:, -1]
            nxt = sample(logits, sampling, generator)
            tp_group = model.topo.tp_group
            if tp_group is not None and model.topo.tp_size > 1:
                dist.broadcast(nxt, src=dist.get_global_rank(tp_group, 0), group=tp_group)
            if eos_id is not None:
                nxt = nxt.masked_fill(done, eos_id)
                done |= nxt == eos_id
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            step_input = nxt[:, None]
            if eos_id is not None and bool(done.all()):
                break
    finally:
        model.train(was_training)
    return ids
