"""``--hf-config`` (tools/estimate_memory.py, plan_layout.py) reads a Hub config.json as the model
``tools/checkpoint/convert.py`` builds from it, MoE included: a Mixtral, Qwen2-MoE or Qwen3-MoE
config is not estimated as a dense model."""

import json

import pytest

from megazero.config import load_config
from megazero.convert.hf import hf_config_to_megazero
from megazero.planner.presets import hf_config_argv

MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
           "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
           "max_position_embeddings": 32768, "rope_theta": 1e6, "num_local_experts": 8,
           "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
QWEN2_MOE = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
             "num_hidden_layers": 6, "hidden_size": 256, "intermediate_size": 512,
             "moe_intermediate_size": 128, "shared_expert_intermediate_size": 512,
             "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1000,
             "max_position_embeddings": 2048, "rope_theta": 1e6, "num_experts": 8,
             "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 2,
             "mlp_only_layers": [], "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
             "use_sliding_window": False}
# Qwen3-30B-A3B's config.json as the Hub ships it (head_dim 128 at hidden 2048 / 32 heads)
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
             "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 128,
             "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
             "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
             "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
             "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
             "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
             "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
             "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False,
             "vocab_size": 151936}


# Qwen3-0.6B's (dense, tied embeddings, head_dim 128 at hidden 1024 / 16 heads)
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128,
         "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
         "max_position_embeddings": 40960, "model_type": "qwen3", "num_attention_heads": 16,
         "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
         "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
         "use_sliding_window": False, "vocab_size": 151936}


@pytest.mark.parametrize("hf", [MIXTRAL, QWEN2_MOE, QWEN3_MOE],
                         ids=["mixtral", "qwen2_moe", "qwen3_moe"])
def test_the_estimator_reads_the_converters_moe_model(hf, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    got = load_config(hf_config_argv(str(path)), world_size=1).model
    want = hf_config_to_megazero(hf)
    assert got.moe.enabled
    for field in ("num_experts", "moe_router_topk", "moe_layer_freq",
                  "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                  "moe_router_pre_softmax"):
        assert getattr(got.moe, field) == getattr(want.moe, field), field
    assert (got.moe.moe_ffn_hidden_size or got.ffn_size) == (
        want.moe.moe_ffn_hidden_size or want.ffn_size)
    assert (got.num_layers, got.hidden_size, got.query_groups, got.vocab_size) == (
        want.num_layers, want.hidden_size, want.query_groups, want.vocab_size)
    assert got.qkv_bias == want.qkv_bias
    assert (got.qk_layernorm, got.head_dim) == (want.qk_layernorm, want.head_dim)


@pytest.mark.parametrize("hf,count", [(MIXTRAL, "46,702,792,704"),
                                      (QWEN3_MOE, "30,532,122,624"), (QWEN3, "596,049,920")],
                         ids=["mixtral-8x7b", "qwen3-30b-a3b", "qwen3-0.6b"])
def test_models_count_their_published_parameters(tmp_path, hf, count):
    """Mixtral 8x7B: 46.7B parameters (Mistral AI's figure), not the 7B of a dense model.
    Qwen3-30B-A3B: 30.5B (the Hub's count: 128 experts, head_dim 128, q/k norms); Qwen3-0.6B:
    0.6B with 0.44B outside the (tied) embedding, as its model card says."""
    import subprocess
    import sys

    from megazero.testing.launch import REPO

    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    out = subprocess.run([sys.executable, "tools/estimate_memory.py", "--hf-config", str(path),
                          "--world-size", "8"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert f"parameters on the worst rank (pp stage 0): {count}" in out.stdout, (
        out.stdout + out.stderr)


def test_qwen3_dense_config_maps_like_the_converter(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3))
    got = load_config(hf_config_argv(str(path)), world_size=1).model
    want = hf_config_to_megazero(QWEN3)
    assert (got.qk_layernorm, got.head_dim, got.untie_embeddings_and_output_weights) == (
        want.qk_layernorm, want.head_dim, want.untie_embeddings_and_output_weights) == (
        True, 128, False)
    assert not got.moe.enabled and got.ffn_size == want.ffn_size == 3072
