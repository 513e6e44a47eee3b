"""Megatron's ``--calculate-per-token-loss``: the loss is the sum over every loss token of the
global batch over their count, so it does not depend on how the batch is cut into micro-batches
or ranks (a mean of per-micro-batch means does, once ``--eod-mask-loss`` leaves micro-batches
with different token counts); without a mask it trains exactly as the default."""

from __future__ import annotations

import numpy as np
import pytest

from megazero.data.indexed_dataset import IndexedDatasetBuilder
from megazero.testing.distributed import run_distributed
from megazero.testing.training_runs import TINY

ARGS = [*TINY[1:], "--train-iters", "3", "--vocab-size", "12", "--global-batch-size", "8"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Short documents, each ended by the NullTokenizer's eod (11): micro-batches hold
    different numbers of loss tokens under --eod-mask-loss."""
    prefix = str(tmp_path_factory.mktemp("corpus") / "docs")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for _ in range(300):
            b.add_document(np.append(rng.integers(0, 11, size=int(rng.integers(2, 12))), 11))
        b.finalize()
    return ["--data-path", prefix, "--split", "100,0,0"]


def _losses(rank, world, runs):
    """(losses, grad norms) of 3 iterations for each command line of ``runs``, in one world."""
    from megazero.testing.training_runs import train_in_rank

    out = []
    for args in runs:
        _, run = train_in_rank(rank, world, args, keep_run=True)
        out.append(([h["loss"] for h in run.state.history],
                    [h["grad_norm"] for h in run.state.history]))
    return out


def test_per_token_loss_is_the_global_token_mean_at_any_cut(corpus):
    masked = [*ARGS, *corpus, "--eod-mask-loss"]
    per_token = [*masked, "--calculate-per-token-loss"]
    # without a mask every micro-batch has as many tokens: the same training as the default
    # (plain SGD without clipping: the update is the gradient itself, not a normalised one)
    plain = [*ARGS, *corpus, "--optimizer", "sgd", "--clip-grad", "0", "--lr", "0.5"]
    a, b, d, e, f, g = run_distributed(_losses, 1, [
        [*per_token, "--micro-batch-size", "2"], [*per_token, "--micro-batch-size", "1"],
        [*masked, "--micro-batch-size", "2"], [*masked, "--micro-batch-size", "1"],
        [*plain, "--calculate-per-token-loss"], plain])[0]
    # dp 2 x pp 2: the token counts cross both
    c, = run_distributed(_losses, 4, [[*per_token, "--micro-batch-size", "1",
                                       "--pipeline-model-parallel-size", "2",
                                       "--zero-stage", "1"]])[0]
    for run in (b, c):  # losses and the grad norm of the token mean
        assert run[0] == pytest.approx(a[0], rel=1e-5) and run[1] == pytest.approx(a[1], rel=1e-4)
    # the mean of micro-batch means moves with the cut
    assert abs(d[0][0] - e[0][0]) > 1e-4
    assert f[0] == pytest.approx(g[0], rel=1e-5) and f[1] == pytest.approx(g[1], rel=1e-5)
    assert f[0][2] < f[0][0] - 0.01  # it trains
