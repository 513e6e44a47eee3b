"""Checkpoint files are data: no code runs on load, damage is one clear error on every rank."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from megazero.checkpoint import load_checkpoint, save_checkpoint
from megazero.checkpoint.files import sha256
from megazero.checkpoint.reader import meta_digest
from megazero.distributed.topology import ParallelTopology
from megazero.errors import CheckpointError
from megazero.testing.checkpoint_state import build_state, save_single, train_steps
from megazero.testing.distributed import DistributedTestError, run_distributed
from megazero.testing.training_runs import TINY, train_in_rank
from megazero.training.builders import ChunkTrackers


class _Payload:
    """Unpickling this would create ``path`` (arbitrary code execution)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _load_single(root, **kw):
    topo = ParallelTopology.single()
    models, opt, sched, tracker = build_state(topo, seed=3)
    return load_checkpoint(root, topo, models=models, optimizer=opt, scheduler=sched,
                           rng_tracker=tracker, **kw)


def _rewrite_checksum(directory, rel):
    meta_path = os.path.join(directory, "metadata.json")
    meta = json.load(open(meta_path))
    path = os.path.join(directory, rel)
    meta["files"][rel] = {"sha256": sha256(path), "bytes": os.path.getsize(path)}
    meta["sha256"] = meta_digest(meta)
    json.dump(meta, open(meta_path, "w"))


def test_pickle_payload_does_not_execute(tmp_path):
    directory = save_single(str(tmp_path / "ck"))
    marker = tmp_path / "pwned"
    rel = "mp_rank_00_000_000/model_000.pt"
    torch.save({"model0.weight@0": {"weight": _Payload(str(marker))}},
               os.path.join(directory, rel))
    _rewrite_checksum(directory, rel)  # a consistent, malicious checkpoint
    with pytest.raises(CheckpointError,
                       match=r"mp_rank_00_000_000/model_000\.pt cannot be read safely"):
        _load_single(str(tmp_path / "ck"))
    assert not marker.exists()


def _damage(path, damage):
    data = open(path, "rb").read()
    if damage == "truncate":
        open(path, "wb").write(data[: len(data) // 2])
    elif damage == "flip":
        i = len(data) // 2
        open(path, "wb").write(data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:])
    else:
        os.remove(path)


# Every kind of file a save writes (the tracker: see test_tracker_*), with the ZeRO engine.
KINDS = ["mp_rank_00_000_000/model_000.pt", "mp_rank_00_000_000/optim_000.pt",
         "mp_rank_00_000_000/optim_rng.pt", "config.json", "metadata.json"]
DAMAGES = ["truncate", "flip", "missing"]
RUN = [*TINY, "--num-layers", "2", "--train-iters", "2", "--zero-stage", "1"]


def _damage_every_kind(rank, world, tmp):
    root = os.path.join(tmp, "ck")
    _, run = train_in_rank(rank, world, [*RUN, "--save", root], keep_run=True)
    directory = os.path.join(root, "iter_0000002")
    files = sorted(os.path.relpath(os.path.join(b, f), directory)
                   for b, _, fs in os.walk(directory) for f in fs)
    out = {}
    for rel in KINDS:
        for damage in DAMAGES:
            case = os.path.join(tmp, f"{damage}-{rel.replace('/', '-')}")
            shutil.copytree(root, case)
            _damage(os.path.join(case, "iter_0000002", rel), damage)
            try:  # as pretrain_gpt.py --load would (training._load), without a new setup
                load_checkpoint(case, run.topo, models=run.chunks, optimizer=run.engine,
                                scheduler=run.scheduler, zero_stage=1, config=run.cfg,
                                rng_tracker=ChunkTrackers(run.chunks))
                out[rel, damage] = None
            except CheckpointError as e:
                out[rel, damage] = str(e)
    return files, out


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    [res] = run_distributed(_damage_every_kind, 1, str(tmp_path_factory.mktemp("dmg")),
                            timeout=300)
    return res


@pytest.mark.parametrize("rel", KINDS)
@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_file_is_one_error_naming_the_file(damaged, damage, rel):
    files, out = damaged
    assert files == sorted(KINDS)  # every kind of file is damaged in turn
    expect = {"truncate": "has [0-9]+ bytes, metadata.json records", "flip": "SHA-256",
              "missing": "is missing"}[damage]
    if rel == "metadata.json":
        expect = {"truncate": "cannot be read", "flip": "SHA-256|cannot be read",
                  "missing": "has no metadata.json: the save of iteration 2 did not complete"
                  }[damage]
        rel = "iter_0000002" if damage == "missing" else rel
    msg = out[rel if rel != "iter_0000002" else "metadata.json", damage]
    assert msg is not None, "the damaged checkpoint loaded"
    assert re.search(rf"{rel.replace('.', '[.]')}.*({expect})", msg), msg
    assert "\n" not in msg


def test_flipped_metadata_value_is_caught_by_its_own_checksum(tmp_path):
    """A flip that keeps metadata.json valid JSON (a digit of the consumed samples)."""
    directory = save_single(str(tmp_path / "ck"))
    path = os.path.join(directory, "metadata.json")
    text = open(path).read()
    assert '"consumed_samples": 24' in text
    open(path, "w").write(text.replace('"consumed_samples": 24', '"consumed_samples": 34'))
    with pytest.raises(CheckpointError, match=r"metadata[.]json fails its SHA-256 check"):
        _load_single(str(tmp_path / "ck"))


def _tracker_case(root, case):
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    text = {"garbage": "iter_3\n", "empty": "", "negative": "-3", "binary": "\x00\xff\x13",
            "flip": chr(ord("3") ^ 0x10), "absent": "9", "incomplete": "5"}.get(case)
    if case == "incomplete":  # a save that died before its metadata.json
        os.makedirs(os.path.join(root, "iter_0000005", "mp_rank_00_000"))
    if case == "deleted":
        os.remove(tracker)
    else:
        open(tracker, "w", encoding="latin-1").write(text)
    return tracker


@pytest.mark.parametrize("case", ["garbage", "empty", "negative", "binary", "flip", "absent",
                                  "incomplete", "deleted"])
def test_tracker_that_names_no_complete_checkpoint_is_an_error_naming_the_newest(tmp_path,
                                                                                 case):
    """``latest`` is authoritative (Megatron, DeepSpeed): no silent fallback to another
    iteration; the error names the newest complete checkpoint and how to resume from it."""
    root = str(tmp_path / "ck")
    save_single(root)
    tracker = _tracker_case(root, case)
    with pytest.raises(CheckpointError) as e:
        _load_single(root)
    msg = str(e.value)
    cause = {"absent": f"{tracker} names iteration 9, but {root}/iter_0000009 does not exist",
             "incomplete": f"{tracker} names iteration 5, but {root}/iter_0000005 has no "
                           "metadata.json: the save of iteration 5 did not complete",
             "deleted": f"{root} has no latest_checkpointed_iteration.txt, but holds complete "
                        "checkpoints"}.get(case, f"{tracker} holds ")
    assert msg.startswith(cause), msg
    assert (f"the newest complete checkpoint is iteration 3: write 3 into {tracker} to resume "
            "from it") in msg, msg
    assert "\n" not in msg


def test_tracker_may_name_an_older_checkpoint_and_none_means_a_fresh_start(tmp_path):
    root = str(tmp_path / "ck")
    save_single(root)
    topo = ParallelTopology.single()
    models, opt, sched, tracker = build_state(topo)
    train_steps(models, opt, sched, 1)
    save_checkpoint(root, 1, topo, models=models, optimizer=opt, scheduler=sched,
                    consumed_samples=8, config={"model": {"hidden_size": 4}},
                    rng_tracker=tracker)
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() == "1"
    res = _load_single(root)  # iteration 3 is newer, but the tracker names 1: a roll-back
    assert (res.iteration, res.consumed_samples) == (1, 8)
    os.remove(os.path.join(root, "latest_checkpointed_iteration.txt"))
    for d in os.listdir(root):
        os.remove(os.path.join(root, d, "metadata.json"))  # no save ever completed here
    assert _load_single(root) is None
    assert _load_single(str(tmp_path / "empty")) is None


def test_truncated_metadata_and_other_model(tmp_path):
    root = str(tmp_path / "ck")
    directory = save_single(root)
    with pytest.raises(CheckpointError, match=r"--hidden-size is 8 but the checkpoint was "
                       r"saved with 4 \(config\.json\)"):
        _load_single(root, config={"model": {"hidden_size": 8}})
    meta = os.path.join(directory, "metadata.json")
    text = open(meta).read()
    open(meta, "w").write(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"iter_0000003/metadata\.json cannot be read"):
        _load_single(root)


def _save_tp2(rank, world, root):
    topo = ParallelTopology.build(tp=2)
    models, opt, sched, tracker = build_state(topo)
    train_steps(models, opt, sched, 1)
    save_checkpoint(root, 1, topo, models=models, optimizer=opt, scheduler=sched,
                    consumed_samples=8, config={}, rng_tracker=tracker)


def _load_tp2(rank, world, root):
    topo = ParallelTopology.build(tp=2)
    models, opt, sched, tracker = build_state(topo, seed=1)
    before = models[0].weight.detach().clone()
    try:
        load_checkpoint(root, topo, models=models, optimizer=opt, scheduler=sched,
                        rng_tracker=tracker)
    except CheckpointError as e:
        # nothing was applied on any rank: the error came before any state changed
        return str(e), torch.equal(before, models[0].weight)
    return None, None


def test_all_ranks_agree_before_loading(tmp_path):
    root = str(tmp_path / "ck")
    run_distributed(_save_tp2, 2, root, timeout=60)
    path = os.path.join(root, "iter_0000001", "mp_rank_01_000_000", "model_000.pt")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:100])  # only tp rank 1 reads this shard
    out = run_distributed(_load_tp2, 2, root, timeout=60)
    assert len({msg for msg, _ in out}) == 1  # every rank raises the same message
    for msg, untouched in out:
        assert "mp_rank_01_000_000/model_000.pt has 100 bytes" in msg and untouched
    with pytest.raises(DistributedTestError):  # (a run that does not catch it stops)
        run_distributed(_load_and_raise, 2, root, timeout=60)


def _load_and_raise(rank, world, root):
    msg, _ = _load_tp2(rank, world, root)
    raise CheckpointError(msg)


def test_old_format_is_one_line(tmp_path):
    root = str(tmp_path / "ck")
    directory = save_single(root)
    meta = os.path.join(directory, "metadata.json")
    old = json.load(open(meta))
    json.dump({"iteration": 3, "layout": old["layout"]}, open(meta, "w"))  # format 1 marker
    with pytest.raises(CheckpointError, match="old per-layout format") as e:
        _load_single(root)
    assert "\n" not in str(e.value)
