"""DeepSeek-V3's published config through the estimator: 671B parameters, 37.6B active per
token (its report: 671B and 37B), and 11.6B more in the multi-token-prediction module (its
"14B" counts the copies of the embedding and head its checkpoints keep); the count from the
config equals the count of the model megazero builds, on tiny models of every kind; and
estimate_memory.py --hf-config prices the model at DeepSeek's training layout."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from megazero.config import ModelConfig, load_config
from megazero.config.moe_schema import MoEConfig
from megazero.planner.param_counts import parameter_counts
from megazero.planner.presets import deepseek_v3_argv

CONFIG = os.path.join(os.path.dirname(__file__), "configs", "deepseek_v3_config.json")
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer"]


def test_deepseek_v3_counts_671b_and_37b_active():
    cfg = load_config(deepseek_v3_argv(json.load(open(CONFIG, encoding="utf-8"))) + MOCK)
    c = parameter_counts(cfg.model)
    assert c.main == 671_026_419_200
    assert c.main_active == 37_552_297_472
    assert c.mtp == 11_610_068_224
    assert cfg.model.moe.moe_router_num_groups == 8 and cfg.model.mtp_num_layers == 1


TINY = dict(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
            make_vocab_size_divisible_by=16)
MOE = MoEConfig(num_experts=8, moe_ffn_hidden_size=12, moe_router_topk=2,
                moe_layer_freq=(0, 1, 1), moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=24)
KINDS = {
    "deepseek": ModelConfig(**TINY, position_embedding_type="rope", normalization="RMSNorm",
                            swiglu=True, add_bias_linear=False, multi_latent_attention=True,
                            q_lora_rank=12, kv_lora_rank=8, qk_head_dim=6,
                            qk_pos_emb_head_dim=4, v_head_dim=10, moe=MOE, mtp_num_layers=2,
                            untie_embeddings_and_output_weights=True),
    "mla-no-q-lora-biases": ModelConfig(**TINY, position_embedding_type="rope",
                                        multi_latent_attention=True, kv_lora_rank=8,
                                        qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=10),
    "gpt2-gqa-gated-moe": ModelConfig(**TINY, num_query_groups=2, group_query_attention=True,
                                      moe=replace(MOE, moe_shared_expert_gate=True,
                                                  moe_router_enable_expert_bias=False,
                                                  moe_router_score_function="softmax"),
                                      mtp_num_layers=1),
    "llama-qk-norm": ModelConfig.preset("llama", **TINY, qk_layernorm=True),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_counts_equal_the_built_model(kind):
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel

    m = KINDS[kind]
    model = GPTModel(m, ParallelTopology.single())
    c = parameter_counts(m)
    assert c.total == sum(p.numel() for p in model.parameters())
    mtp = model.mtp
    assert c.mtp == (0 if mtp is None else sum(p.numel() for p in mtp.parameters()))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    e, k = m.moe.num_experts or 1, m.moe.moe_router_topk
    assert c.active == c.total - experts + experts * k // e


def test_estimate_memory_reads_the_deepseek_config(capsys):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "tools", "estimate_memory.py")
    spec = importlib.util.spec_from_file_location("estimate_memory", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    # DeepSeek-V3 trained at PP 16 x EP 64 (x DP 128 with ZeRO-1) on 2,048 H800s; 61 layers
    # split unevenly there, here 64 (4 a stage, as its fullest stages) stand in for them
    assert tool.main(["--hf-config", CONFIG, "--cluster", "h800-80gb", "--world-size", "2048",
                      "--json", "--", "--pipeline-model-parallel-size", "16",
                      "--expert-model-parallel-size", "64", "--bf16", "--zero-stage", "1",
                      "--micro-batch-size", "1", "--global-batch-size", "15360",
                      "--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1", "--num-layers", "64",
                      "--moe-layer-freq", "([0]*3+[1]*61)"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parameters"]["mtp"] == 11_610_068_224
    # the last stage holds 4 MoE layers (4 of 256 experts each), the head, the MTP module and
    # the embedding copy MTP reads: the worst rank, 36.3 GB with full recomputation
    assert out["worst_pp_rank"] == 15 and out["fits"]
    assert 25e9 < out["device_total"] < 50e9


@pytest.mark.parametrize("kind", ["deepseek", "mla-no-q-lora-biases"])
def test_model_flops_price_mla_and_mtp(kind):
    """The FLOPs the log line and the planner count equal the GEMMs torch's FLOP counter sees
    in the model's forward (core attention aside: SDPA on CPU is not counted)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel
    from megazero.observability.flops import attention_flops_per_token, gpt_flops_per_iteration

    m = replace(KINDS[kind], moe=replace(KINDS[kind].moe, moe_router_load_balancing_type="none"),
                attention_dropout=0.0, hidden_dropout=0.0)
    model = GPTModel(m, ParallelTopology.single()).eval()
    toks = torch.randint(0, m.vocab_size, (2, m.seq_length),
                         generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(toks, toks)
    core = attention_flops_per_token(m)[1] * (m.num_layers + (m.mtp_num_layers or 0))
    padded = model.padded_vocab_size
    want = gpt_flops_per_iteration(m, 2, padded) / 3 - core * 2 * m.seq_length
    assert counter.get_total_flops() == want
