"""Well-known model sizes as pretrain_gpt.py flags, and Hugging Face config.json -> flags.

Presets are flags rather than config objects so that they go through the same parser and
validation as a real launch (``megazero.config.load_config``).
"""

from __future__ import annotations

import json
from pathlib import Path

from megazero.config import ConfigError

_GPT = "--seq-length 2048 --max-position-embeddings 2048 --vocab-size 50257"
LLAMA_FLAGS = ("--swiglu --normalization RMSNorm --position-embedding-type rope "
          "--untie-embeddings-and-output-weights --disable-bias-linear "
          "--attention-dropout 0 --hidden-dropout 0")

MODEL_PRESETS: dict[str, str] = {
    "gpt2-125m": f"--num-layers 12 --hidden-size 768 --num-attention-heads 12 {_GPT}",
    "gpt2-350m": f"--num-layers 24 --hidden-size 1024 --num-attention-heads 16 {_GPT}",
    "gpt2-760m": f"--num-layers 24 --hidden-size 1536 --num-attention-heads 16 {_GPT}",
    "gpt2-1.3b": f"--num-layers 24 --hidden-size 2048 --num-attention-heads 16 {_GPT}",
    "gpt3-175b": f"--num-layers 96 --hidden-size 12288 --num-attention-heads 96 {_GPT}",
    "llama2-7b": f"--num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
                 f"--ffn-hidden-size 11008 --seq-length 4096 --vocab-size 32000 {LLAMA_FLAGS}",
    "llama2-13b": f"--num-layers 40 --hidden-size 5120 --num-attention-heads 40 "
                  f"--ffn-hidden-size 13824 --seq-length 4096 --vocab-size 32000 {LLAMA_FLAGS}",
    "llama2-70b": f"--num-layers 80 --hidden-size 8192 --num-attention-heads 64 "
                  f"--group-query-attention --num-query-groups 8 --ffn-hidden-size 28672 "
                  f"--seq-length 4096 --vocab-size 32000 {LLAMA_FLAGS}",
    "llama3-8b": f"--num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
                 f"--group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 "
                 f"--seq-length 8192 --vocab-size 128256 --rotary-base 500000 {LLAMA_FLAGS}",
    # Megatron-LM's examples/mixtral: 8 experts, top-2, 46.7B parameters (12.9B active)
    "mixtral-8x7b": f"--num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
                    f"--group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 "
                    f"--seq-length 4096 --vocab-size 32000 --rotary-base 1000000 "
                    f"--num-experts 8 --moe-router-topk 2 {LLAMA_FLAGS}",
}


def preset_argv(name: str) -> list[str]:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"--model {name!r}: unknown preset; use one of {list(MODEL_PRESETS)} "
                          f"or --hf-config config.json")
    return MODEL_PRESETS[name].split()


def hf_config_argv(path: str) -> list[str]:
    """Flags for a Llama-family or GPT-2 ``config.json`` from the Hugging Face hub."""
    try:
        c = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--hf-config {path}: cannot read it as JSON ({exc})") from exc
    if c.get("model_type") == "deepseek_v3":
        return deepseek_v3_argv(c, path)
    if "n_embd" in c:  # GPT-2
        n = c.get("n_positions", 1024)
        return (f"--num-layers {c['n_layer']} --hidden-size {c['n_embd']} --num-attention-heads "
                f"{c['n_head']} --seq-length {n} --max-position-embeddings {n} --vocab-size "
                f"{c['vocab_size']}").split()
    try:
        heads = c["num_attention_heads"]
        argv = (f"--num-layers {c['num_hidden_layers']} --hidden-size {c['hidden_size']} "
                f"--num-attention-heads {heads} --ffn-hidden-size {c['intermediate_size']} "
                f"--vocab-size {c['vocab_size']} --seq-length "
                f"{min(c.get('max_position_embeddings', 4096), 8192)} "
                f"--rotary-base {c.get('rope_theta', 10000.0)} {LLAMA_FLAGS}").split()
    except KeyError as exc:
        raise ConfigError(f"--hf-config {path}: missing key {exc}; expected a Llama-style "
                          f"(num_hidden_layers, hidden_size, intermediate_size...) or GPT-2 "
                          f"(n_layer, n_embd, n_head) config") from exc
    kv = c.get("num_key_value_heads", heads)
    if kv != heads:
        argv += ["--group-query-attention", "--num-query-groups", str(kv)]
    if c.get("tie_word_embeddings", False):
        argv.remove("--untie-embeddings-and-output-weights")
    if c.get("qkv_bias") or c.get("model_type") in ("qwen2", "qwen2_moe"):
        argv.append("--add-qkv-bias")  # Qwen2's attention: biases on q, k, v only
    if c.get("head_dim") not in (None, c["hidden_size"] // heads):  # Qwen3's 128 at any width
        argv += ["--kv-channels", str(c["head_dim"])]
    if c.get("model_type") in ("qwen3", "qwen3_moe"):
        argv.append("--qk-layernorm")  # Qwen3's per-head query/key RMSNorms
    return argv + _moe_argv(c)


def deepseek_v3_argv(c: dict, path: str = "config.json") -> list[str]:
    """Flags of a DeepSeek-V3 ``config.json``: the model the Hugging Face import builds
    (:func:`megazero.convert.hf_deepseek_v3.config_to_megazero`), plus its multi-token
    prediction depths (``num_nextn_predict_layers``), at its pretraining length (YaRN's
    ``original_max_position_embeddings``, 4096)."""
    from megazero.convert.hf_config import ConversionError
    from megazero.convert.hf_deepseek_v3 import config_to_megazero

    def refuse(what: str, why: str) -> None:
        raise ConfigError(f"--hf-config {path}: {what} ({why})")

    try:
        m = config_to_megazero(c, refuse)
    except (KeyError, ConversionError) as exc:
        raise ConfigError(f"--hf-config {path}: not a DeepSeek-V3 config we can read ({exc})"
                          ) from exc
    seq = m.original_max_position_embeddings or min(m.max_positions, 8192)
    argv = (f"--num-layers {m.num_layers} --hidden-size {m.hidden_size} --num-attention-heads "
            f"{m.num_attention_heads} --ffn-hidden-size {m.ffn_size} --vocab-size "
            f"{m.vocab_size} --seq-length {seq} --max-position-embeddings {m.max_positions} "
            f"--rotary-base {m.rotary_base} --multi-latent-attention --kv-lora-rank "
            f"{m.kv_lora_rank} --qk-head-dim {m.qk_head_dim} --qk-pos-emb-head-dim "
            f"{m.qk_pos_emb_head_dim} --v-head-dim {m.v_head_dim} {LLAMA_FLAGS}").split()
    if m.q_lora_rank:
        argv += ["--q-lora-rank", str(m.q_lora_rank)]
    if m.rotary_scaling_factor > 1:
        argv += ["--rotary-scaling-factor", str(m.rotary_scaling_factor), "--mscale",
                 str(m.mscale), "--mscale-all-dim", str(m.mscale_all_dim),
                 "--original-max-position-embeddings", str(m.original_max_position_embeddings)]
    if not m.untie_embeddings_and_output_weights:
        argv.remove("--untie-embeddings-and-output-weights")
    moe = m.moe
    if moe.enabled:
        argv += ["--num-experts", str(moe.num_experts), "--moe-router-topk",
                 str(moe.moe_router_topk), "--moe-ffn-hidden-size", str(moe.moe_ffn_hidden_size),
                 "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-topk-scaling-factor", str(moe.moe_router_topk_scaling_factor),
                 "--moe-router-load-balancing-type", "seq_aux_loss",
                 "--moe-layer-freq", "[" + ",".join(map(str, moe.moe_layer_freq)) + "]"]
        if moe.moe_router_num_groups:
            argv += ["--moe-router-num-groups", str(moe.moe_router_num_groups),
                     "--moe-router-group-topk", str(moe.moe_router_group_topk)]
        if moe.moe_shared_expert_intermediate_size:
            argv += ["--moe-shared-expert-intermediate-size",
                     str(moe.moe_shared_expert_intermediate_size)]
    if c.get("num_nextn_predict_layers"):
        argv += ["--mtp-num-layers", str(c["num_nextn_predict_layers"])]
    return argv


def _moe_argv(c: dict) -> list[str]:
    """MoE flags of a Mixtral (``num_local_experts``), Qwen2-MoE or Qwen3-MoE
    (``num_experts``) config, the mapping ``tools/checkpoint/convert.py`` uses; [] for a dense
    model."""
    qwen = c.get("model_type") in ("qwen2_moe", "qwen3_moe")
    experts = c.get("num_local_experts") or (c.get("num_experts") if qwen else None)
    if not experts:
        return []
    argv = ["--num-experts", str(experts), "--moe-router-topk",
            str(c.get("num_experts_per_tok", 2))]
    if qwen:
        layers, step = int(c["num_hidden_layers"]), int(c.get("decoder_sparse_step", 1))
        dense = set(c.get("mlp_only_layers") or ())
        sparse = [int(i not in dense and step >= 1 and (i + 1) % step == 0)
                  for i in range(layers)]
        argv += ["--moe-ffn-hidden-size", str(c["moe_intermediate_size"])]
        if not all(sparse):
            argv += ["--moe-layer-freq", "[" + ",".join(map(str, sparse)) + "]"]
        if c.get("shared_expert_intermediate_size"):
            argv += ["--moe-shared-expert-intermediate-size",
                     str(c["shared_expert_intermediate_size"]), "--moe-shared-expert-gate"]
        if not c.get("norm_topk_prob", False):
            argv.append("--moe-router-pre-softmax")
    return argv
