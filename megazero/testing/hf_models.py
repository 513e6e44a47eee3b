"""Tiny Hugging Face models built in code (never downloaded) for the conversion tests."""

import torch

VOCAB = 100


def gpt2_config(**kw):
    import transformers

    base = dict(n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=VOCAB,
                bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2Config(**{**base, **kw})


def llama_config(**kw):
    import transformers

    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2)
    return transformers.LlamaConfig(**{**base, **kw})


def build(kind: str, seed: int = 0, **kw):
    """A randomly initialised tiny GPT2LMHeadModel / LlamaForCausalLM in eval mode, fp32, with
    norms perturbed away from 1/0 so a swapped norm weight or bias changes the logits."""
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(gpt2_config(**kw))
    else:
        model = transformers.LlamaForCausalLM(llama_config(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def hf_config_dict(model) -> dict:
    return model.config.to_dict()


BPE_MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"),
              ("Ġw", "or"), ("l", "d"), ("Ġ", "h")]


def write_bpe_files(directory) -> tuple[str, str, int]:
    """A tiny GPT-2 byte-level BPE (every byte, a few merges, ``<|endoftext|>`` last):
    ``(vocab.json path, merges.txt path, vocabulary size)``."""
    import json
    import os

    from megazero.data.gpt2_bpe import EOD_TOKEN, bytes_to_unicode

    symbols = list(bytes_to_unicode().values()) + ["".join(m) for m in BPE_MERGES] + [EOD_TOKEN]
    vocab, merges = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    with open(vocab, "w", encoding="utf-8") as f:
        json.dump({s: i for i, s in enumerate(symbols)}, f)
    with open(merges, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in BPE_MERGES) + "\n")
    return vocab, merges, len(symbols)


def deepseek_v3_config(**kw):
    """A tiny DeepSeek-V3: q_lora on, YaRN, the first layer dense, 8 routed experts in 4 groups
    (2 chosen per token), one shared expert, routed scaling 2.5."""
    import transformers

    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
                kv_lora_rank=12, q_lora_rank=20, qk_rope_head_dim=4, v_head_dim=10,
                qk_nope_head_dim=6, n_group=4, topk_group=2, num_experts_per_tok=3,
                first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=64,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 16, "mscale": 1.0,
                                 "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
                rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                attention_dropout=0.0)
    return transformers.DeepseekV3Config(**{**base, **kw})


def build_deepseek_v3(seed: int = 0, **kw):
    """A random tiny DeepseekV3ForCausalLM in eval mode, fp32: norms perturbed, and expert
    biases and router weights large enough that the groups and the bias decide the routing."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(deepseek_v3_config(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()
