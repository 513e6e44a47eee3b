"""The ZeRO engine driving the real GPTModel on gloo equals single-process AdamW on the full
batch: dp 4 (stages 0-3, offload, overlap), tp 2 x dp 2 with and without sequence parallelism
(stages 0-3), and pp 2 x dp 2 through the pipeline executor (stages 0-3, tied embeddings,
interleaving, micro-batch accumulation; stage 3 with every unit released between a micro-batch's
forward and its backward).

Tolerance: fp32, dropout 0; only summation orders differ (TP partial sums, dp reduction, the
sharded norm). Losses agree to ~1e-6; weights to ~2e-5 of each tensor's largest entry after
ten AdamW steps (Adam divides by sqrt(v), so elements with small gradients turn rounding
differences into visible update differences). We allow 2e-5 absolute on losses and 1e-4
relative to the largest entry of each weight tensor; a missing or doubled reduction, a wrong
shard or a wrong clip coefficient gives errors of 1e-2 and more. Most cases have no linear
biases: the key bias's true gradient is exactly zero (softmax ignores a constant per row), so
its gradient is pure rounding noise that Adam normalises into O(lr) updates, which no two
summation orders reproduce. Two tp2 x dp2 sequence-parallel cases (stages 1 and 3) keep the
biases on (a row-parallel bias is summed over TP); there the weights agree to ~2e-5 too.
"""

from dataclasses import replace

import torch
import torch.distributed as dist

from megazero.config import ModelConfig, OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.pipeline.executor import forward_backward
from megazero.pipeline.partition import build_model_chunks
from megazero.tensor_parallel import ParallelContext, full_model_state_dict
from megazero.testing import run_distributed
from megazero.testing.reference import torch_adamw
from megazero.zero import build_zero_optimizer

SEQ, VOCAB, HIDDEN, STEPS, ROWS = 16, 100, 32, 10, 8  # ROWS: global batch
# eps 1e-6: Adam's update is scale-free, so an element whose gradient is at rounding level
# (~1e-9) would get an O(lr) update from noise alone with eps 1e-8.
OPT = OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.5, adam_eps=1e-6)
CPU = OffloadConfig(device="cpu")
TOL, WTOL = 2e-5, 1e-4


def gpt_config(layers: int = 2) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4,
                       seq_length=SEQ, vocab_size=VOCAB, attention_dropout=0.0,
                       hidden_dropout=0.0, add_bias_linear=False)


def batches():
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def reference(cfg):
    single = ParallelTopology.single()
    model = GPTModel(cfg, single)
    opt = torch_adamw(model, OPT)
    losses, norms = [], []
    for tokens, labels in batches():
        opt.zero_grad()
        loss = model(tokens, labels).mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.clip_grad).item())
        opt.step()
        losses.append(loss.item())
    return losses, full_model_state_dict(model, single), norms


def _dp_mean(x: float, topo) -> float:
    t = torch.tensor([x])
    dist.all_reduce(t, group=topo.dp_group)
    return t.item() / topo.dp_size


def _compare(chunks, topo, ref_w):
    err = 0.0
    for chunk in chunks:
        for name, w in full_model_state_dict(chunk, topo).items():
            if name == "output_layer.weight" and name not in ref_w:
                name = "embedding.word_embeddings.weight"  # the last stage's tied copy
            ref = ref_w[name]
            err = max(err, ((w - ref).abs().max() / ref.abs().max()).item())
    return err


def _run_flat(topo, cfg, zkw, sp, micro, ref_w):
    """tp x dp without pipelining: this dp rank's rows, ``micro`` micro-batches."""
    model = GPTModel(cfg, topo, parallel=ParallelContext.from_topology(topo, sequence_parallel=sp))
    engine = build_zero_optimizer([model], OPT, ZeroConfig(**zkw), PrecisionConfig(), topo,
                                  sequence_parallel=sp)
    rows = ROWS // topo.dp_size
    losses, norms = [], []
    for tokens, labels in batches():
        tokens = tokens[topo.dp_rank * rows:(topo.dp_rank + 1) * rows]
        labels = labels[topo.dp_rank * rows:(topo.dp_rank + 1) * rows]
        engine.zero_grad()
        total, mb = 0.0, rows // micro
        for i in range(micro):
            with engine.no_sync() if i < micro - 1 else _nullcontext():
                loss = model(tokens[i * mb:(i + 1) * mb], labels[i * mb:(i + 1) * mb]).mean()
                engine.backward(loss / micro)
            total += loss.item() / micro
        engine.finish_grad_sync()
        res = engine.step()
        assert res.updated
        losses.append(_dp_mean(total, topo))
        norms.append(res.grad_norm)
    with engine.gathered_parameters():  # stage 3: full weights for the comparison
        return losses, _compare([model], topo, ref_w), norms


def _run_pipeline(topo, cfg, zkw, vpp, micro):
    lpvs = None if vpp is None else cfg.num_layers // (topo.pp_size * vpp)
    chunks = build_model_chunks(cfg, topo, lpvs)
    engine = build_zero_optimizer(chunks, OPT, ZeroConfig(**zkw), PrecisionConfig(), topo)
    rows = ROWS // topo.dp_size
    mbs = rows // micro
    losses, norms = [], []
    for tokens, labels in batches():
        mine = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
        data = [{"tokens": tokens[mine][i * mbs:(i + 1) * mbs],
                 "labels": labels[mine][i * mbs:(i + 1) * mbs]} for i in range(micro)]
        engine.zero_grad()
        out = forward_backward(chunks, iter(data), topo, micro, SEQ, mbs, HIDDEN,
                               grad_sync=engine)
        engine.finish_grad_sync()
        res = engine.step()
        assert res.updated
        losses.append(_dp_mean(sum(out) / micro, topo))
        norms.append(res.grad_norm)
    return losses, chunks, norms, engine


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _cases():
    stages = [("0", dict(stage=0)), ("1", dict(stage=1)), ("2", dict(stage=2)),
              ("3", dict(stage=3)), ("2+offload", dict(stage=2, offload_optimizer=CPU)),
              ("3+offload", dict(stage=3, offload_optimizer=CPU, offload_param=CPU))]
    out = []
    for overlap in (False, True):
        for name, kw in stages:
            kw = dict(kw, overlap_comm=overlap, reduce_bucket_size=4000,
                      stage3_param_persistence_threshold=0)
            out.append((f"dp4 stage {name} overlap={overlap}", 1, 1, None, kw, False,
                        1 + overlap))
    for i, (name, kw) in enumerate(stages):
        sp, overlap = i % 2 == 0, i % 3 != 0
        kw = dict(kw, overlap_comm=overlap, reduce_bucket_size=4000,
                  stage3_param_persistence_threshold=0)
        out.append((f"tp2 dp2 stage {name} sp={sp} overlap={overlap}", 2, 1, None, kw, sp, 2))
    # Linear biases: a row-parallel linear's stage-3 unit holds its TP-split weight and its
    # sequence-parallel bias; only the bias gradient is summed over TP.
    for stage in (1, 3):
        kw = dict(stage=stage, reduce_bucket_size=4000, stage3_param_persistence_threshold=0)
        out.append((f"tp2 dp2 stage {stage} sp=True biases", 2, 1, None, kw, True, 2))
    for stage, vpp, overlap in [(0, None, False), (1, None, True), (2, None, True),
                                (2, 2, False), (1, 2, True)]:
        kw = dict(stage=stage, overlap_comm=overlap, reduce_bucket_size=4000)
        out.append((f"pp2 dp2 stage {stage} vpp={vpp} overlap={overlap}", 1, 2, vpp, kw, False,
                    2))
    # Stage 3 under 1F1B: several micro-batches' forwards run before their backwards. Reuse
    # distance 0 releases every unit after each forward, so each backward gathers it again;
    # a small prefetch bucket and live-parameter cap exercise the recorded order.
    for vpp, overlap, micro, extra in [
            (None, False, 4, dict(stage3_max_reuse_distance=0)),
            (2, True, 2, dict(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=2000,
                              stage3_max_live_parameters=6000)),
            (2, False, 4, dict(offload_optimizer=CPU, offload_param=CPU))]:
        kw = dict(stage=3, overlap_comm=overlap, stage3_param_persistence_threshold=0, **extra)
        out.append((f"pp2 dp2 stage 3 vpp={vpp} overlap={overlap} micro={micro} {extra}", 1, 2,
                    vpp, kw, False, micro))
    return out


def _gpt_world(rank, world_size):
    cfg2, cfg4 = gpt_config(2), gpt_config(4)
    refs = {2: reference(cfg2), 4: reference(cfg4)}
    results = []
    for name, tp, pp, vpp, zkw, sp, micro in _cases():
        topo = ParallelTopology.build(tp=tp, pp=pp, vpp=vpp)
        layers = 4 if vpp else 2
        cfg = cfg4 if vpp else cfg2
        if "biases" in name:
            cfg = replace(cfg2, add_bias_linear=True)
            refs["biases"] = refs.get("biases") or reference(cfg)
            layers = "biases"
        ref_losses, ref_w, ref_norms = refs[layers]
        if pp > 1:
            losses, chunks, norms, engine = _run_pipeline(topo, cfg, zkw, vpp, micro)
            with engine.gathered_parameters():  # stage 3: full weights for the comparison
                werr = _compare(chunks, topo, ref_w)
        else:
            losses, werr, norms = _run_flat(topo, cfg, zkw, sp, micro, ref_w)
        lerr = max(abs(a - b) for a, b in zip(losses, ref_losses))
        nerr = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
        results.append((name, lerr, werr, nerr, max(ref_norms)))
    return results


def test_gpt_zero_matches_single_process_adamw():
    out = run_distributed(_gpt_world, 4, timeout=400)
    for rank_results in out:
        assert len(rank_results) == len(_cases())
        for name, lerr, werr, nerr, max_norm in rank_results:
            assert lerr < TOL, f"{name}: loss error {lerr:.3g}"
            assert werr < WTOL, f"{name}: weight error {werr:.3g}"
            assert nerr < 1e-4, f"{name}: grad-norm relative error {nerr:.3g}"
            assert max_norm > OPT.clip_grad  # clipping was active"
