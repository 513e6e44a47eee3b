"""Pipeline chunks chained by hand equal the full model; dropout masks follow the TP rules and
are replayed exactly by recomputation."""

import torch
import torch.distributed as dist

from megazero.config import RecomputeConfig
from megazero.distributed.topology import ParallelTopology
from megazero.model.gpt import GPTModel
from megazero.tensor_parallel import full_model_state_dict
from megazero.tensor_parallel.context import ParallelContext
from megazero.testing import run_distributed
from megazero.testing.tiny_gpt import (
    assert_close,
    batch,
    loss_and_grads,
    stage0_engine,
    tiny_config,
)

WORD = "embedding.word_embeddings.weight"


def _pipeline_chunks(rank, world):
    tokens, labels = batch(1)
    checked = 0
    for tp, sp in ((1, False), (2, False), (2, True)):
        topo = ParallelTopology.build(tp=tp)
        for preset in ("gpt2", "llama"):  # tied and untied embeddings
            cfg = tiny_config(preset)
            ref_loss, ref_grads = loss_and_grads(GPTModel(cfg, ParallelTopology.single()),
                                                 ParallelTopology.single(), tokens, labels)
            parallel = ParallelContext.from_topology(topo, sequence_parallel=sp)
            first = GPTModel(cfg, topo, parallel=parallel, layer_range=(0, 1),
                             post_process=False)
            last = GPTModel(cfg, topo, parallel=parallel, layer_range=(1, 2),
                            pre_process=False)
            engine = stage0_engine([first, last], topo, sp)
            hidden = first(tokens)
            assert hidden.shape == (16 // (tp if sp else 1), 2, cfg.hidden_size)
            received = hidden.detach().requires_grad_()
            loss = last(None, labels, hidden_states=received)
            loss.mean().backward()
            hidden.backward(received.grad)
            engine.finish_grad_sync()
            assert_close(loss.detach(), ref_loss, "chunked loss")
            grads = {**full_model_state_dict(first, topo, grads=True),
                     **full_model_state_dict(last, topo, grads=True)}
            tied = not cfg.untie_embeddings_and_output_weights
            if tied:
                out_w = last.output_layer.weight
                emb_w = first.embedding.word_embeddings.weight
                assert torch.equal(out_w, emb_w), "tied output copy must start equal"
                assert out_w.shared_embedding and out_w.shared
                assert emb_w.shared_embedding and not getattr(emb_w, "shared", False)
                assert last.shared_embedding_or_output_weight() is out_w
                assert first.shared_embedding_or_output_weight() is emb_w
                grads[WORD] = grads[WORD] + grads.pop("output_layer.weight")
            assert sorted(grads) == sorted(ref_grads)
            for name, g in grads.items():
                assert_close(g, ref_grads[name], f"tp={tp} sp={sp} {preset} chunked d{name}")
            checked += 1
    return checked


def test_pipeline_chunks_equal_full_model():
    assert run_distributed(_pipeline_chunks, 2, timeout=300) == [6, 6]


def _dropout_cfg():
    return tiny_config("gpt2", attention_dropout=0.3, hidden_dropout=0.3)


def _recompute_replays_masks(rank, world):
    topo = ParallelTopology.build(tp=2)
    tokens, labels = batch(2)
    out = {}
    for sp in (False, True):
        runs = {}
        for recompute in (RecomputeConfig(), RecomputeConfig("selective"),
                          RecomputeConfig("full", "uniform", 2),
                          RecomputeConfig("full", "block", 1)):
            model = GPTModel(_dropout_cfg(), topo, recompute=recompute,
                             parallel=ParallelContext.from_topology(
                                 topo, sequence_parallel=sp, attention_backend="unfused"))
            loss, grads = loss_and_grads(model, topo, tokens, labels)
            runs[str(recompute)] = (loss, grads)
        base_loss, base_grads = runs[str(RecomputeConfig())]
        model.eval()
        with torch.no_grad():
            eval_loss = model(tokens, labels)
        assert (eval_loss - base_loss).abs().max() > 1e-3, "dropout had no effect"
        for key, (loss, grads) in runs.items():
            assert torch.equal(loss, base_loss), f"sp={sp} {key}: loss"
            for name, g in grads.items():
                assert torch.equal(g, base_grads[name]), f"sp={sp} recompute={key}: d{name}"
        out[sp] = len(runs)
    return out


def test_recompute_reproduces_dropout_masks():
    assert run_distributed(_recompute_replays_masks, 2, timeout=300)[0] == {False: 4, True: 4}


def _mask_agreement(rank, world):
    topo = ParallelTopology.build(tp=2)
    tokens, _ = batch(3)
    masks, kept = [], []
    original = torch.native_dropout

    def recording_dropout(x, p, train):
        y, keep = original(x, p, train)
        masks.append(~keep & (x != 0))  # dropped, among elements that were non-zero
        kept.append(x != 0)
        return y, keep

    torch.native_dropout = recording_dropout
    try:
        for sp in (False, True):
            masks.clear()
            kept.clear()
            model = GPTModel(_dropout_cfg(), topo, parallel=ParallelContext.from_topology(
                topo, sequence_parallel=sp, attention_backend="unfused"))
            model(tokens)
            # Per call: embedding, then (attention probs, attn hidden, mlp hidden) per layer.
            kinds = ["hidden"] + ["attention", "hidden", "hidden"] * 2
            assert len(masks) == len(kinds)
            for kind, mask, valid in zip(kinds, masks, kept):
                gathered = [torch.empty_like(mask, dtype=torch.uint8) for _ in range(2)]
                dist.all_gather(gathered, mask.to(torch.uint8), group=topo.tp_group)
                same = torch.equal(gathered[0], gathered[1])
                if kind == "attention" or sp:  # sharded heads / sequence slices
                    assert not same, f"sp={sp}: {kind} dropout masks equal across TP ranks"
                else:  # replicated activations
                    assert same, f"sp={sp}: {kind} dropout masks differ across TP ranks"
                rate = mask.sum().item() / valid.sum().item()
                assert 0.2 < rate < 0.4, f"{kind}: dropped fraction {rate:.3f}, p=0.3"
    finally:
        torch.native_dropout = original
    return True


def test_dropout_masks_follow_tensor_parallel_regions():
    assert all(run_distributed(_mask_agreement, 2, timeout=300))
