"""ZeRO stages 0-3 (with overlap, offload, fallbacks and bucket options) reproduce a
single-process ``torch.optim.AdamW`` run on the full batch: every loss, every gradient norm and
the final weights.

The gradient norm matters on its own: Adam is nearly invariant to a constant factor on the
gradients and clipping hides one too, so a reduction that sums instead of averaging over dp
(a missing 1/dp) leaves losses and weights almost unchanged, but multiplies the norm by dp."""

import torch
import torch.distributed as dist

from megazero.config import OffloadConfig, OptimizerConfig, PrecisionConfig, ZeroConfig
from megazero.distributed.topology import ParallelTopology
from megazero.testing import run_distributed
from megazero.testing.reference import (
    TinyLM,
    engine_train_step,
    make_batches,
    reference_run,
    torch_adamw,
)
from megazero.zero import build_zero_optimizer

OPT = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
STEPS, BATCH, SEQ, VOCAB = 10, 8, 8, 64
CPU = OffloadConfig(device="cpu", pin_memory=True)
TOL = 2e-5  # fp32 rounding: sums in a different order (dp reduction, sharded norm)


def _tiny() -> TinyLM:
    m = TinyLM(vocab=VOCAB)
    m.embedding.weight.zero_external = True  # tied: used by the output projection too
    return m


def _cases():
    cases = []
    for overlap in (False, True):
        for name, kw in [("0", dict(stage=0)), ("1", dict(stage=1)), ("2", dict(stage=2)),
                         ("3", dict(stage=3)), ("2+offload", dict(stage=2, offload_optimizer=CPU)),
                         ("3+offload", dict(stage=3, offload_optimizer=CPU, offload_param=CPU))]:
            kw = dict(kw, overlap_comm=overlap, reduce_bucket_size=300,
                      stage3_param_persistence_threshold=0)
            cases.append((f"stage {name} overlap={overlap}", kw, {}, 1 + overlap))
    cases += [
        ("stage 1 all-reduce, broadcast, small all-gathers",
         dict(stage=1, reduce_scatter=False, allgather_partitions=False,
              allgather_bucket_size=40, contiguous_gradients=False), {}, 1),
        # "auto" (the default) is all_to_all on gloo; the backend's own reduce-scatter too:
        ("stage 2 reduce-scatter native", dict(stage=2, reduce_bucket_size=500),
         dict(reduce_scatter_impl="native"), 2),
        ("stage 2 reduce-scatter as all_reduce", dict(stage=2, reduce_bucket_size=500),
         dict(reduce_scatter_impl="all_reduce"), 1),
        # "auto" all-reduces through shared memory on one host; the backend's own too:
        ("stage 0 all-reduce on gloo", dict(stage=0, overlap_comm=True, reduce_bucket_size=300),
         dict(shared_memory="backend"), 2),
        ("stage 2 sub-groups of 100", dict(stage=2, sub_group_size=100), {}, 1),
        ("stage 3 persistent small params, prefetch, live limit",
         dict(stage=3, stage3_param_persistence_threshold=100, stage3_prefetch_bucket_size=600,
              stage3_max_live_parameters=1500, stage3_max_reuse_distance=0, overlap_comm=True),
         {}, 2),
    ]
    return cases


def _reference_norms(batches) -> list[float]:
    """The single-process run's gradient norm (before clipping) at every step."""
    model = _tiny()
    opt = torch_adamw(model, OPT)
    norms = []
    for tokens, labels in batches:
        opt.zero_grad()
        model(tokens, labels).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPT.clip_grad)))
        opt.step()
    return norms


def _equivalence_world(rank, world_size):
    topo = ParallelTopology.build()
    batches = make_batches(STEPS, BATCH, SEQ, VOCAB)
    ref_losses, ref_w = reference_run(_tiny, batches, OPT)
    ref_norms = _reference_norms(batches)
    rows = BATCH // topo.dp_size
    mine = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
    results = []
    for name, zkw, extra, micro in _cases():
        model = _tiny()
        names = {id(p): n for n, p in model.named_parameters()}
        engine = build_zero_optimizer([model], OPT, ZeroConfig(**zkw), PrecisionConfig(), topo,
                                      **extra)
        losses, norms = [], []
        for tokens, labels in batches:
            loss, res = engine_train_step(model, engine, tokens[mine], labels[mine], micro)
            t = torch.tensor([loss])
            dist.all_reduce(t)
            losses.append(t.item() / topo.dp_size)
            norms.append(res.grad_norm)
            assert res.updated and not res.skipped
        full = engine.full_parameters()
        dw = max((w - ref_w[names[i]]).abs().max().item() for i, w in full.items())
        dl = max(abs(a - b) for a, b in zip(losses, ref_losses))
        dn = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
        results.append((name, dl, dw, dn, len(full)))
    return results


def test_stages_match_single_process_adamw():
    per_rank = run_distributed(_equivalence_world, 4, timeout=400)
    for results in per_rank:
        assert len(results) == len(_cases())
        for name, dl, dw, dn, n in results:
            assert n == len(list(_tiny().parameters())), name
            assert dl < TOL, f"{name}: loss differs by {dl:.3g}"
            assert dw < TOL, f"{name}: weights differ by {dw:.3g}"
            assert dn < TOL, f"{name}: gradient norm differs by {dn:.3g} (relative)"


def _resume_world(rank, world_size):
    """Save the engine state after 3 steps, load it into a differently initialised model, and
    the next 3 steps must equal those of the uninterrupted run."""
    import io

    topo = ParallelTopology.build()
    batches = make_batches(6, BATCH, SEQ, VOCAB)
    rows = BATCH // topo.dp_size
    mine = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
    out = []
    for name, zkw, prec in [("0", dict(stage=0), PrecisionConfig()),
                            ("1", dict(stage=1), PrecisionConfig()),
                            ("2 fp16", dict(stage=2), PrecisionConfig(fp16=True,
                                                                       initial_scale_power=8)),
                            # the scale doubles every 2 clean steps (after steps 1, 3, 5): the
                            # resumed run must restore the scaler's window position, not only
                            # the scale
                            ("1 fp16 moving scale", dict(stage=1), PrecisionConfig(
                                fp16=True, initial_scale_power=8, loss_scale_window=2)),
                            ("2+offload", dict(stage=2, offload_optimizer=CPU), PrecisionConfig()),
                            ("3", dict(stage=3, stage3_param_persistence_threshold=50),
                             PrecisionConfig()),
                            ("3 bf16", dict(stage=3), PrecisionConfig(bf16=True))]:
        runs = []
        for resume in (False, True):
            model = _tiny()
            engine = build_zero_optimizer([model], OPT, ZeroConfig(**zkw), prec, topo)
            losses, scales = [], []
            for i, (tokens, labels) in enumerate(batches):
                if i == 3:
                    buf = io.BytesIO()
                    torch.save(engine.state_dict(), buf)
                    if resume:  # a fresh model with other weights, then the checkpoint
                        model = TinyLM(vocab=VOCAB, seed=99)
                        model.embedding.weight.zero_external = True
                        engine = build_zero_optimizer([model], OPT, ZeroConfig(**zkw), prec,
                                                      topo)
                        buf.seek(0)
                        engine.load_state_dict(torch.load(buf, weights_only=False))
                loss, res = engine_train_step(model, engine, tokens[mine], labels[mine])
                losses.append(loss)
                scales.append(res.loss_scale)
            runs.append((losses[3:], scales + [engine.loss_scale]))
        out.append((name, max(abs(a - b) for a, b in zip(runs[0][0], runs[1][0])),
                    runs[0][1] == runs[1][1], runs[0][1]))
    return out, _load_weights(topo)


def test_state_dict_resume_and_loaded_weights():
    for results, loaded in run_distributed(_resume_world, 4, timeout=400):
        assert len(results) == 7
        for name, err, same_scale, _ in results:
            assert err < 1e-6 and same_scale, (name, err)
        moving = dict((r[0], r[3]) for r in results)["1 fp16 moving scale"]
        assert moving == [256.0, 256.0, 512.0, 512.0, 1024.0, 1024.0, 2048.0], moving
        assert len(loaded) == 3
        for name, werr, merr, dtype in loaded:
            assert werr <= (0 if dtype == torch.float32 else 1e-2), (name, werr)
            assert merr == 0, (name, merr)


def _load_weights(topo):
    """Weights loaded into the model from outside (no optimizer state) reach the shards and the
    fp32 masters: the next step starts from them."""
    source = TinyLM(vocab=VOCAB, seed=99)
    want = {n: p.detach().clone() for n, p in source.named_parameters()}
    out = []
    for name, zkw, prec in [("3", dict(stage=3, stage3_param_persistence_threshold=50),
                             PrecisionConfig()),
                            ("3 fp16 offload", dict(stage=3, offload_optimizer=CPU,
                                                    offload_param=CPU), PrecisionConfig(fp16=True)),
                            ("2 bf16", dict(stage=2), PrecisionConfig(bf16=True))]:
        model = _tiny()
        engine = build_zero_optimizer([model], OPT, ZeroConfig(**zkw), prec, topo)
        with engine.gathered_parameters(write_back=True):
            model.load_state_dict(source.state_dict())
        names = {id(p): n for n, p in model.named_parameters()}
        full = engine.full_parameters()
        werr = max((w.float() - want[names[i]]).abs().max().item() for i, w in full.items())
        merr = max((p.master - p.model.float()).abs().max().item() for p in engine.pieces())
        out.append((name, werr, merr, prec.params_dtype))
    return out
