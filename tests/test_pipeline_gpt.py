"""Pipeline x tensor x sequence parallelism x recomputation with the real GPTModel, on gloo.

One world of 8 ranks runs every layout (pp4 x tp2, pp2 x tp2 x dp2, pp4 x dp2, pp2 x dp4),
with and without interleaving, m = pp and 2pp micro-batches, tied and untied embeddings.
Gradients are synchronised as in training, by a ZeRO stage-0 engine (``grad_sync=engine``, then
``engine.finish_grad_sync()``: data-parallel average, sequence-parallel and tied-embedding sums).
Each rank also runs the single-process model (tp = pp = 1, same seed) on every data-parallel
replica's micro-batches and compares the loss of each of its micro-batches and the gradient of
every parameter of its chunks, reassembled from the tensor-parallel shards.

Tolerance (fp32, dropout 0): gradients within 2e-5 of the reference relative to the largest
reference entry of that parameter; losses within 1e-5 absolute. Only the summation order
differs (TP partial sums, micro-batch accumulation), so errors are ~1e-7.
"""

import pytest

from megazero.config import (
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    RecomputeConfig,
    ZeroConfig,
)
from megazero.data.random_batches import random_lm_batches
from megazero.distributed.topology import ParallelTopology
from megazero.pipeline.activation_meter import ActivationMeter
from megazero.pipeline.executor import forward_backward
from megazero.pipeline.partition import build_model_chunks
from megazero.tensor_parallel.context import ParallelContext
from megazero.testing import run_distributed
from megazero.zero import build_zero_optimizer

SEQ, MBS, VOCAB, LAYERS, HIDDEN = 16, 2, 100, 8, 32
GRAD_RTOL, LOSS_ATOL = 2e-5, 1e-5


def model_config(tied: bool) -> ModelConfig:
    return ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4,
                       seq_length=SEQ, vocab_size=VOCAB, attention_dropout=0.0,
                       hidden_dropout=0.0, untie_embeddings_and_output_weights=not tied)


def make_batches(m: int, seed: int) -> list[dict]:
    return random_lm_batches(m, VOCAB, MBS, SEQ, seed)


def reference(cfg: ModelConfig, batches: list[dict]) -> tuple[list[float], dict]:
    from megazero.model.gpt import GPTModel
    from megazero.tensor_parallel import full_model_state_dict

    topo = ParallelTopology.single()
    model = GPTModel(cfg, topo)
    losses = []
    for b in batches:
        loss = model(b["tokens"], b["labels"]).mean()
        (loss / len(batches)).backward()
        losses.append(loss.item())
    return losses, full_model_state_dict(model, topo, grads=True)


SELECTIVE = RecomputeConfig("selective")
FULL_UNIFORM_1 = RecomputeConfig("full", "uniform", 1)
# (tp, pp, vpp, m, tied, sequence_parallel, recompute)
CASES = [
    (2, 4, None, 4, True, False, None),
    (2, 4, None, 8, False, True, FULL_UNIFORM_1),
    (2, 4, 2, 4, False, True, None),
    (2, 4, 2, 8, True, True, SELECTIVE),
    (2, 2, None, 2, False, False, RecomputeConfig("full", "block", 2)),
    (2, 2, None, 4, True, True, None),
    (2, 2, 2, 2, True, False, None),
    (2, 2, 2, 4, False, True, RecomputeConfig("full", "uniform", 2)),
    (1, 4, None, 4, False, False, None),
    (1, 4, None, 8, True, False, None),
    (1, 4, 2, 4, True, False, None),
    (1, 4, 2, 8, True, False, None),
    (1, 2, None, 2, True, False, None),
    (1, 2, None, 4, False, False, SELECTIVE),
    (1, 2, 2, 2, False, False, FULL_UNIFORM_1),
    (1, 2, 2, 4, True, False, RecomputeConfig("full", "block", 1)),
]


def _gpt_world(rank, world_size):
    from megazero.tensor_parallel import full_model_state_dict

    results = []
    for tp, pp, vpp, m, tied, sp, recompute in CASES:
        topo = ParallelTopology.build(tp=tp, pp=pp, vpp=vpp)
        cfg = model_config(tied)
        replicas = [make_batches(m, seed=100 + d) for d in range(topo.dp_size)]
        ref_losses, ref_grads = reference(cfg, [b for r in replicas for b in r])
        ref_losses = ref_losses[topo.dp_rank * m:(topo.dp_rank + 1) * m]
        lpvs = None if vpp is None else LAYERS // (pp * vpp)
        chunks = build_model_chunks(cfg, topo, lpvs, recompute=recompute,
                                    parallel=ParallelContext.from_topology(topo,
                                                                           sequence_parallel=sp))
        engine = build_zero_optimizer(chunks, OptimizerConfig(), ZeroConfig(stage=0),
                                      PrecisionConfig(), topo, sequence_parallel=sp)
        meter = ActivationMeter()
        losses = forward_backward(chunks, iter(replicas[topo.dp_rank]), topo, m, SEQ, MBS,
                                  HIDDEN, sequence_parallel=sp, activation_meter=meter,
                                  grad_sync=engine)
        engine.finish_grad_sync()
        loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        grad_err, names = 0.0, []
        for chunk in chunks:
            for name, g in full_model_state_dict(chunk, topo, grads=True).items():
                ref_name = name
                if name == "output_layer.weight" and tied:
                    ref_name = "embedding.word_embeddings.weight"  # the last stage's copy
                ref = ref_grads[ref_name]
                err = ((g - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
                grad_err = max(grad_err, err)
                names.append(name)
        results.append(dict(case=(tp, pp, vpp, m, tied, sp, recompute), loss_err=loss_err,
                            grad_err=grad_err, names=names, pp_rank=topo.pp_rank,
                            tp_rank=topo.tp_rank, peak=meter.peak_inflight,
                            peak_bytes=meter.peak_saved_bytes))
    return results, _with_zero_engine()


def _with_zero_engine():
    """pp2 x tp2 x dp2, interleaved, sequence parallel, tied embeddings, driven through the
    ZeRO stage-0 engine with small buckets and overlap: after ``finish_grad_sync`` the grads are
    the average over both replicas' micro-batches, with the sequence-parallel and
    tied-embedding sums done exactly once."""
    from megazero.tensor_parallel import full_model_state_dict

    m, cfg = 4, model_config(True)
    topo = ParallelTopology.build(tp=2, pp=2, vpp=2)
    per_replica = [make_batches(m, seed=200 + d) for d in range(topo.dp_size)]
    _, ref_grads = reference(cfg, [b for batches in per_replica for b in batches])
    chunks = build_model_chunks(cfg, topo, 2, parallel=ParallelContext.from_topology(
        topo, sequence_parallel=True))
    engine = build_zero_optimizer(chunks, OptimizerConfig(), ZeroConfig(
        stage=0, reduce_bucket_size=2000, overlap_comm=True), PrecisionConfig(), topo,
        sequence_parallel=True)
    forward_backward(chunks, iter(per_replica[topo.dp_rank]), topo, m, SEQ, MBS, HIDDEN,
                     sequence_parallel=True, grad_sync=engine)
    engine.finish_grad_sync()
    worst = 0.0
    for chunk in chunks:
        for name, g in full_model_state_dict(chunk, topo, grads=True).items():
            ref = ref_grads["embedding.word_embeddings.weight" if name == "output_layer.weight"
                            else name]
            worst = max(worst, ((g - ref).abs().max() / ref.abs().max()).item())
    return worst


@pytest.fixture(scope="module")
def world_results():
    return run_distributed(_gpt_world, 8, timeout=300)


@pytest.fixture(scope="module")
def gpt_results(world_results):
    return [r[0] for r in world_results]


def test_gpt_pipeline_with_zero_engine(world_results):
    for _, zero_err in world_results:
        assert zero_err < GRAD_RTOL, zero_err


def test_gpt_pipeline_matches_single_process_model(gpt_results):
    out = gpt_results
    for rank_results in out:
        for r in rank_results:
            assert r["loss_err"] < LOSS_ATOL, r
            assert r["grad_err"] < GRAD_RTOL, r
    # every parameter of the full model was checked somewhere, in every case
    for i, (_, pp, _, _, tied, _, _) in enumerate(CASES):
        seen = {n for rank_results in out for n in rank_results[i]["names"]}
        layers = {n.split(".")[2] for n in seen if n.startswith("decoder.layers.")}
        assert layers == {str(k) for k in range(LAYERS)}, (CASES[i], layers)
        assert "embedding.word_embeddings.weight" in seen
        assert "decoder.final_layernorm.weight" in seen
        assert ("output_layer.weight" in seen) == (pp > 1 or not tied)


def test_gpt_activation_memory_on_first_stage(gpt_results):
    """Rank 0 holds pp micro-batches of a stage's activations with 1F1B, and Megatron's
    1 + (p-1)/(p v) times that with the interleaved schedule (m = 2p = 8, p = 4, v = 2)."""
    rank0 = {r["case"]: r for r in gpt_results[0]}
    one_f1b, inter = rank0[(1, 4, None, 8, True, False, None)], rank0[(1, 4, 2, 8, True, False,
                                                                      None)]
    assert one_f1b["peak"] == 4  # not m = 8
    assert inter["peak"] == 11  # chunk-micro-batches: 2(p-1) + (v-1)p + 1
    factor = inter["peak_bytes"] / one_f1b["peak_bytes"]
    assert abs(factor - (1 + 3 / 8)) < 0.03, factor


# --- micro-batch counts that only a group size makes valid, trained end to end ----------------

GROUPS_TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
               "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
               "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "12",
               "--lr", "3e-3", "--lr-warmup-iters", "1", "--attention-dropout", "0",
               "--hidden-dropout", "0", "--log-interval", "1000", "--eval-interval", "1000",
               "--eval-iters", "0", "--seed", "11", "--train-iters", "3"]
# pp2 x dp2: 3 micro-batches per replica; pp4: 6. Neither is a multiple of pp, so the default
# group size (pp) refuses both; N = M runs them, as in megatron-core.
GROUP_LAYOUTS = {
    "pp2 x dp2 x vpp2, M=3, N=3": ["--pipeline-model-parallel-size", "2",
                                   "--num-layers-per-virtual-pipeline-stage", "2",
                                   "--microbatch-group-size-per-virtual-pipeline-stage", "3"],
    "pp4 x vpp2, M=6, N=6": ["--pipeline-model-parallel-size", "4",
                             "--num-layers-per-virtual-pipeline-stage", "1",
                             "--microbatch-group-size-per-virtual-pipeline-stage", "6"],
}
# fp32, 3 AdamW steps: only the summation order differs from the one-process run.
TRAIN_LOSS_RTOL, WEIGHT_ATOL = 1e-6, 1e-6


def _trained(rank, world, layouts):
    from megazero.tensor_parallel import full_model_state_dict
    from megazero.testing.training_runs import train_in_rank

    out = {}
    for name, flags in layouts.items():
        losses, run = train_in_rank(rank, world, [*GROUPS_TINY, *flags], keep_run=True)
        weights = {}
        for chunk in run.chunks:
            for n, t in full_model_state_dict(chunk, run.topo).items():
                weights[n] = t.detach().numpy().copy()
        out[name] = dict(losses=losses, weights=weights, m=run.batching.num_microbatches,
                         group=run.cfg.parallel.microbatch_group_size_per_vp_stage)
    return out


@pytest.fixture(scope="module")
def grouped_runs():
    [ref] = run_distributed(_trained, 1, {"single": []}, timeout=200)
    ranks = run_distributed(_trained, 4, GROUP_LAYOUTS, timeout=300)
    return ref["single"], ranks


def test_group_size_runs_train_like_one_process(grouped_runs):
    import numpy as np

    ref, ranks = grouped_runs
    assert sorted(ref["losses"]) == [1, 2, 3] and ref["m"] == 6
    assert ref["losses"][3] < ref["losses"][1]  # it learns
    for name in GROUP_LAYOUTS:
        seen = set()
        for rank in ranks:
            r = rank[name]
            assert (r["m"], r["group"]) in ((3, 3), (6, 6)), name
            for it, loss in ref["losses"].items():
                assert r["losses"][it] == pytest.approx(loss, rel=TRAIN_LOSS_RTOL, abs=0), name
            for n, w in r["weights"].items():
                ref_name = "embedding.word_embeddings.weight" if n == "output_layer.weight" else n
                err = float(np.abs(w - ref["weights"][ref_name]).max())
                assert err < WEIGHT_ATOL, (name, n, err)
                seen.add(n)
        assert {n for n in ref["weights"]} <= seen, name
