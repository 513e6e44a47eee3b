"""Packed documents kept apart (--reset-position-ids, --reset-attention-mask): the per-token
loss of a packed sequence equals, token for token, the loss of each document run alone
(fp32, to rounding), with standard attention and with multi-latent attention, at one rank,
at TP 2 + SP and at CP 2 (documents cut by the zigzag split); without the packed inputs the
documents see each other (the losses differ). The batch's ids and positions follow Megatron's
rule (the end-of-document token closes its document)."""

from __future__ import annotations

import pytest
import torch

from megazero.config import ModelConfig
from megazero.model.packed import document_ids, document_positions

EOD, VOCAB, LENGTHS = 0, 64, (5, 11, 7, 9)
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
            vocab_size=VOCAB, position_embedding_type="rope", normalization="RMSNorm",
            swiglu=True, add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
            make_vocab_size_divisible_by=16)
MLA = dict(multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=8, qk_head_dim=6,
           qk_pos_emb_head_dim=4, v_head_dim=10)
CONFIGS = {"gqa": ModelConfig(**BASE, num_query_groups=2, group_query_attention=True),
           "mla": ModelConfig(**BASE, **MLA),
           "learned": ModelConfig(**{**BASE, "position_embedding_type": "learned_absolute"})}


def _packed() -> tuple[torch.Tensor, torch.Tensor]:
    """Two packed sequences of documents (each ended by EOD): tokens and labels [2, 32]."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for lengths in (LENGTHS, LENGTHS[::-1]):
        parts = []
        for n in lengths:
            parts += [*torch.randint(1, VOCAB, (n - 1,), generator=g).tolist(), EOD]
        rows.append(parts + [int(torch.randint(1, VOCAB, (1,), generator=g))])
    seq = torch.tensor(rows)
    return seq[:, :-1], seq[:, 1:]


def _batch() -> dict[str, torch.Tensor]:
    tokens, labels = _packed()
    docs = document_ids(tokens, EOD)
    return {"tokens": tokens, "labels": labels, "document_ids": docs,
            "doc_position_ids": document_positions(docs)}


def _model(cfg, topo=None, sp=False):
    from megazero.distributed.topology import ParallelTopology
    from megazero.model.gpt import GPTModel
    from megazero.tensor_parallel.context import ParallelContext

    topo = topo or ParallelTopology.single()
    return GPTModel(cfg, topo, parallel=ParallelContext.from_topology(topo, sequence_parallel=sp),
                    seed=11)


def _alone(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` each token's loss with its document run alone (NaN at each document's EOD,
    whose target is the next document's first token: --eod-mask-loss masks it)."""
    out = torch.full(tokens.shape, float("nan"))
    for b in range(tokens.shape[0]):
        start = 0
        ends = (tokens[b] == EOD).nonzero().flatten().tolist() + [tokens.shape[1]]
        for end in ends:
            if end > start:  # tokens start..end-1 predict start+1..end
                with torch.no_grad():
                    loss = model(tokens[b:b + 1, start:end], labels[b:b + 1, start:end])
                out[b, start:end] = loss[0]
            start = end + 1
    return out


def _compare(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    keep = ~torch.isnan(want)
    assert keep.sum() > keep.numel() * 3 // 4
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-6, msg=what)


def test_ids_and_positions_follow_megatron():
    tokens = torch.tensor([[3, 0, 4, 5, 0, 0, 6]])
    docs = document_ids(tokens, EOD)
    assert docs.tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 0, 0]]


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_packed_loss_equals_each_document_alone(kind):
    model = _model(CONFIGS[kind]).eval()
    batch = _batch()
    want = _alone(model, batch["tokens"], batch["labels"])
    with torch.no_grad():
        got = model(batch["tokens"], batch["labels"], doc_position_ids=batch["doc_position_ids"],
                    document_ids=batch["document_ids"])
        crossing = model(batch["tokens"], batch["labels"])  # today's: documents see each other
    _compare(got, want, kind)
    keep = ~torch.isnan(want)
    assert not torch.allclose(crossing[keep], want[keep], rtol=1e-3)


def _world(rank, world_size):
    from megazero.context_parallel.batch import split_batch
    from megazero.context_parallel.split import local_positions
    from megazero.distributed.topology import ParallelTopology

    out = {}
    full = _batch()
    for kind in ("gqa", "mla"):
        for name, topo, sp, comm in (
                ("tp2+sp", ParallelTopology.build(tp=2), True, "p2p"),
                ("cp2 p2p", ParallelTopology.build(cp=2), False, "p2p"),
                ("cp2 a2a", ParallelTopology.build(cp=2), False, "a2a")):
            from megazero.tensor_parallel.context import ParallelContext

            batch = split_batch(full, topo.cp_rank, topo.cp_size)
            from megazero.model.gpt import GPTModel

            model = GPTModel(CONFIGS[kind], topo, parallel=ParallelContext.from_topology(
                topo, sequence_parallel=sp, cp_comm_type=comm), seed=11)
            loss = model(batch["tokens"], batch["labels"],
                         doc_position_ids=batch["doc_position_ids"],
                         document_ids=batch["document_ids"])
            loss.sum().backward()  # the gathered keys' gradients reduce-scatter back
            pos = (local_positions(32, topo.cp_rank, 2) if topo.cp_size > 1
                   else torch.arange(32))
            out[(kind, name)] = (loss.detach(), pos)
    return out


def test_packed_loss_at_tp2_sp_and_cp2():
    from megazero.testing import run_distributed

    batch = _batch()
    wants = {kind: _alone(_model(CONFIGS[kind]).eval(), batch["tokens"], batch["labels"])
             for kind in ("gqa", "mla")}
    results = run_distributed(_world, 2, timeout=240)
    for rank, result in enumerate(results):
        assert len(result) == 6
        for (kind, name), (loss, pos) in result.items():
            _compare(loss, wants[kind][:, pos], f"rank {rank} {kind} {name}")
