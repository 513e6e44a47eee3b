"""The model's shape: :class:`ModelConfig` (Megatron's model flags; its MoE section is
:mod:`megazero.config.moe_schema`) and the rules that split it over tensor- and
context-parallel ranks, which the config's validation and a model built directly from a
:class:`ModelConfig` both call."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from megazero.config.moe_schema import MoEConfig
from megazero.config.rules import check, check_sequence_split, divisors, sequence_parallel_active
from megazero.config.rules import check as _check


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4h; with swiglu Megatron's 8h/3 rounded to 64
    num_query_groups: int | None = None  # grouped-query attention; None = one group per head
    seq_length: int = 64
    max_position_embeddings: int | None = None  # default seq_length
    vocab_size: int = 1024  # tokenizer's vocabulary; padded by the embedding layer
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # the share of each head's dims RoPE rotates (GPT-NeoX, Megatron)
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximated GELU (GPT-2's "gelu_new"), Megatron's flag
    add_bias_linear: bool = True
    # a bias on the fused QKV linear whatever add_bias_linear says (Megatron's --add-qkv-bias;
    # Qwen2's attention): read it through ``qkv_bias``
    add_qkv_bias: bool = False
    untie_embeddings_and_output_weights: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    kv_channels: int | None = None  # Megatron's per-head width; default hidden / heads
    use_flash_attn: bool = True  # used only when flash-attn is installed and tensors are on GPU
    group_query_attention: bool = False  # Megatron's switch; the group count is num_query_groups
    model_preset: Literal["gpt2", "llama"] | None = None  # the preset the fields started from
    # Megatron's elementwise fusions (megazero.fusions, through torch.compile), on by default
    # as in Megatron; they run on CUDA, and on CPU only with fusions_on_cpu (for tests)
    bias_gelu_fusion: bool = True
    bias_swiglu_fusion: bool = True
    bias_dropout_fusion: bool = True
    apply_rope_fusion: bool = True
    fusions_on_cpu: bool = False
    moe: MoEConfig = field(default_factory=MoEConfig)  # Mixture of Experts; dense when unset
    # Megatron's --qk-layernorm (Qwen3): --normalization over each head's queries and keys
    # (one head_dim weight each, shared by the heads) after the QKV projection, before RoPE
    qk_layernorm: bool = False
    # Megatron's --apply-layernorm-1p: zero-centred norm weights, the norms scale by 1 + weight
    apply_layernorm_1p: bool = False
    # Megatron's --transformer-impl; megazero runs its own layers for either value
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    # multi-head latent attention (megatron-core's --multi-latent-attention, DeepSeek-V2/V3):
    # queries (with --q-lora-rank) and keys/values through a low-rank latent, RoPE on a
    # separate --qk-pos-emb-head-dim part whose key all heads share (megazero.model.mla)
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: queries by one projection
    kv_lora_rank: int = 32
    qk_head_dim: int = 128  # each head's positionless query/key width
    qk_pos_emb_head_dim: int = 64  # the rotated part's width
    v_head_dim: int = 128
    # YaRN (DeepSeek-V3's rope_scaling): on when the factor is above 1
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_max_position_embeddings: int | None = None  # YaRN's pretraining length
    # multi-token prediction (megatron-core's --mtp-num-layers, DeepSeek-V3): N modules after
    # the main model, module k predicting the token k + 1 ahead (megazero.model.mtp)
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # a config read back from JSON (checkpoint, converter)
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "vocab_size", "make_vocab_size_divisible_by"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, f"--{name.replace('_', '-')} must be a positive "
                   f"integer, got {v!r}")
        _check(self.kv_channels is not None
               or self.hidden_size % self.num_attention_heads == 0,
               f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
               f"{self.num_attention_heads}; pick a hidden size that is a multiple of the heads "
               "or set the head width with --kv-channels")
        if self.num_query_groups is not None:
            _check(self.num_query_groups > 0
                   and self.num_attention_heads % self.num_query_groups == 0,
                   f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                   f"--num-query-groups {self.num_query_groups}")
        _check(self.position_embedding_type in ("learned_absolute", "rope"),
               f"--position-embedding-type {self.position_embedding_type!r}: expected "
               f"learned_absolute or rope")
        _check(self.normalization in ("LayerNorm", "RMSNorm"),
               f"--normalization {self.normalization!r}: expected LayerNorm or RMSNorm")
        _check(not self.group_query_attention or self.num_query_groups is not None,
               "--group-query-attention needs --num-query-groups N (the number of key/value "
               "heads)")
        _check(self.kv_channels is None
               or (isinstance(self.kv_channels, int) and self.kv_channels > 0),
               f"--kv-channels must be a positive integer, got {self.kv_channels!r}")
        self._check_mla()
        _check(self.mtp_num_layers is None or (isinstance(self.mtp_num_layers, int)
                                               and self.mtp_num_layers >= 1),
               f"--mtp-num-layers must be a positive integer, got {self.mtp_num_layers!r}")
        _check(self.mtp_loss_scaling_factor >= 0,
               f"--mtp-loss-scaling-factor must be >= 0, got {self.mtp_loss_scaling_factor}")
        rot = self.head_dim * self.rotary_percent
        _check(0 < self.rotary_percent <= 1 and rot == int(rot) and int(rot) % 2 == 0,
               f"--rotary-percent {self.rotary_percent}: expected 0 < p <= 1 with head dim "
               f"{self.head_dim} x p an even integer (e.g. 0.25, 0.5, 1.0)")
        _check(self.max_positions >= self.seq_length,
               f"--max-position-embeddings {self.max_position_embeddings} is smaller than "
               f"--seq-length {self.seq_length}")

    def _check_mla(self) -> None:
        if not self.multi_latent_attention:
            for flag, v, default in (("--q-lora-rank", self.q_lora_rank, None),
                                     ("--rotary-scaling-factor", self.rotary_scaling_factor,
                                      1.0)):
                _check(v == default, f"{flag} {v} applies to multi-latent attention only; add "
                       "--multi-latent-attention or drop it")
            return
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0,
                   f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        _check(self.q_lora_rank is None or self.q_lora_rank > 0,
               f"--q-lora-rank must be a positive integer, got {self.q_lora_rank!r}")
        _check(self.qk_pos_emb_head_dim % 2 == 0,
               f"--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim} must be even (RoPE turns "
               "pairs of dims)")
        _check(self.position_embedding_type == "rope",
               "--multi-latent-attention rotates its --qk-pos-emb-head-dim part: it needs "
               "--position-embedding-type rope")
        _check(self.num_query_groups is None,
               "--num-query-groups does not apply to --multi-latent-attention (its heads share "
               "one latent); drop --num-query-groups / --group-query-attention")
        _check(self.rotary_percent == 1.0 and not self.qk_layernorm,
               "--rotary-percent and --qk-layernorm do not apply to --multi-latent-attention "
               "(RoPE acts on the whole --qk-pos-emb-head-dim part, the latents have their "
               "own norms); drop them")
        _check(self.rotary_scaling_factor >= 1.0,
               f"--rotary-scaling-factor {self.rotary_scaling_factor} must be >= 1 (1: no YaRN)")

    @property
    def yarn(self) -> Any:
        """The YaRN scaling of the rotary tables (a :class:`megazero.model.positional.YaRN`),
        or None."""
        if not self.multi_latent_attention or self.rotary_scaling_factor <= 1.0:
            return None
        from megazero.model.positional import YaRN

        return YaRN(self.rotary_scaling_factor,
                    self.original_max_position_embeddings or self.max_positions,
                    self.mscale, self.mscale_all_dim)

    @property
    def head_dim(self) -> int:
        """Each head's width: ``--kv-channels`` (Megatron's name; Qwen3's ``head_dim``, which
        may differ from hidden / heads), by default hidden / heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates; the rest pass through (with MLA:
        the decoupled positional part)."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.head_dim * self.rotary_percent)

    @property
    def qkv_bias(self) -> bool:
        """Whether the fused QKV linear has a bias: every linear has one, or only QKV
        (``--disable-bias-linear --add-qkv-bias``, Qwen2). The one place the rule lives."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return max(64, int(4 * self.hidden_size * 2 / 3) // 64 * 64)
        return 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """``gpt2``: learned positions, LayerNorm, GELU, biases, tied embeddings.
        ``llama``: RoPE, RMSNorm, SwiGLU, no biases, untied embeddings, grouped-query attention.
        """
        presets = {
            "gpt2": dict(),
            "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                          add_bias_linear=False, untie_embeddings_and_output_weights=True),
        }
        _check(name in presets, f"unknown model preset {name!r}; expected one of {list(presets)}")
        return cls(**{**presets[name], **overrides})


def check_tensor_parallel_split(m: ModelConfig, tp: int, sequence_parallel: bool,
                                world_size: int | None = None, others: int = 1) -> None:
    """Can this model be split over ``tp`` ranks? One rule for the CLI config and for a model
    built directly from a :class:`ModelConfig`; every message names the numbers and the fix.
    With ``world_size`` the TP sizes offered are those the world holds beside the ``others``
    (pp x cp) ranks."""

    def fits(n: int) -> list[int]:
        return [d for d in divisors(n) if world_size is None or world_size % (d * others) == 0]

    check(m.num_attention_heads % tp == 0,
          f"--num-attention-heads {m.num_attention_heads} is not divisible by "
          f"--tensor-model-parallel-size {tp}; use a TP size that divides the heads "
          f"({fits(m.num_attention_heads)}) or a multiple of {tp} heads")
    check(m.query_groups % tp == 0,
          f"--num-query-groups {m.query_groups} is not divisible by --tensor-model-parallel-size "
          f"{tp}; each TP rank needs whole key/value groups: use a TP size in "
          f"{fits(m.query_groups)} or a multiple of {tp} groups")
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
