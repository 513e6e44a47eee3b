"""A TP/SP model on gloo ranks equals the single-process tp=1 model: loss, every gradient
(reassembled from shards) and the weights themselves.

Tolerance: fp32 with the reductions done in a different order (sums split across ranks, fused
QKV rows regrouped) differ from the reference by a few ulps of the largest terms, so we compare
with ``|got - ref| <= 1e-5 * max|ref| + 1e-7`` per tensor: 1e-5 relative to the tensor's
magnitude is ~100 ulps of fp32, far below any real error (a wrong mask, missing reduction or
misplaced shard gives O(1) relative errors).
"""

import torch

from megazero.config import (
    RecomputeConfig,
)
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.tensor_parallel import full_model_state_dict, gather_from_tensor_parallel_region
from megazero.tensor_parallel.context import ParallelContext
from megazero.testing import run_distributed
from megazero.testing.tiny_gpt import (
    BATCH,
    SEQ,
    VOCAB,
    assert_close,
    batch,
    loss_and_grads,
    tiny_config,
)


def max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / (ref.abs().max() + 1e-12)).item()


def _equivalence(rank, world):
    torch.manual_seed(0)
    tokens, labels = batch()
    results = []
    for tp in (1, 2, 4):
        topo = ParallelTopology.build(tp=tp)
        for preset in ("gpt2", "llama"):
            cfg = tiny_config(preset)
            ref = GPTModel(cfg, ParallelTopology.single())
            ref_loss, ref_grads = loss_and_grads(ref, ParallelTopology.single(), tokens, labels)
            ref_weights = full_model_state_dict(ref, ParallelTopology.single())
            for sp in (False, True):
                for recompute in (RecomputeConfig(), RecomputeConfig("selective"),
                                  RecomputeConfig("full", "uniform", 1),
                                  RecomputeConfig("full", "block", 1)):
                    if tp == 1 and (sp or recompute.granularity == "full"):
                        continue
                    model = GPTModel(cfg, topo, recompute=recompute,
                                     parallel=ParallelContext.from_topology(
                                         topo, sequence_parallel=sp))
                    what = f"tp={tp} {preset} sp={sp} recompute={recompute}"
                    weights = full_model_state_dict(model, topo)
                    for name, w in weights.items():  # bitwise slices of the tp=1 model
                        assert torch.equal(w, ref_weights[name]), f"{what}: {name}"
                    loss, grads = loss_and_grads(model, topo, tokens, labels)
                    worst = assert_close(loss, ref_loss, f"{what}: loss")
                    for name, g in grads.items():
                        worst = max(worst, assert_close(g, ref_grads[name], f"{what}: d{name}"))
                    results.append((what, worst))
            if tp == 4:  # the unfused core attention (memory measurements use it)
                model = GPTModel(cfg, topo, recompute=RecomputeConfig("selective"),
                                 parallel=ParallelContext.from_topology(
                                     topo, sequence_parallel=True, attention_backend="unfused"))
                loss, grads = loss_and_grads(model, topo, tokens, labels)
                assert_close(loss, ref_loss, f"unfused {preset}: loss")
                for name, g in grads.items():
                    assert_close(g, ref_grads[name], f"unfused {preset}: d{name}")
                results.append((f"tp=4 {preset} sp unfused", 0.0))
                # without labels: this rank's vocab shard of the logits, pad columns at -inf
                with torch.no_grad():
                    shard = model(tokens)
                    ref_logits = ref(tokens)
                assert shard.shape == (BATCH, SEQ, model.padded_vocab_size // tp)
                full = gather_from_tensor_parallel_region(shard, topo.tp_group)
                assert torch.isinf(full[..., VOCAB:]).all() and (full[..., VOCAB:] < 0).all()
                assert_close(full[..., :VOCAB], ref_logits[..., :VOCAB], f"{preset} logits")
    return results


def test_tp_sp_recompute_equivalence():
    results = run_distributed(_equivalence, 4, timeout=300)
    assert len(results[0]) == 2 * (2 + 2 * 2 * 4) + 2


def test_recompute_without_input_grad_keeps_parameter_grads():
    cfg = tiny_config("gpt2")
    topo = ParallelTopology.single()
    tokens, labels = batch(4)
    ref = GPTModel(cfg, topo, layer_range=(0, 2), pre_process=False)
    full = GPTModel(cfg, topo, layer_range=(0, 2), pre_process=False,
                    recompute=RecomputeConfig("full", "uniform", 2))
    hidden = torch.randn(SEQ, BATCH, cfg.hidden_size)  # does not require grad
    grads = []
    for model in (ref, full):
        model(None, labels, hidden_states=hidden).mean().backward()
        grads.append(full_model_state_dict(model, topo, grads=True))
    for name, g in grads[0].items():
        assert g.abs().sum() > 0, name
        assert torch.equal(grads[1][name], g), name
