"""ZB-H1, ZBV, DualPipeV and 1F1B with delayed weight gradients, proven by the checker: every
F/B/W once, W after its B, messages matched in order without deadlock, the bubble and the
peak of micro-batches held against 1F1B's, and planted faults refused by name."""

import re

import pytest

from megazero.config import ConfigError
from megazero.pipeline.checker import ScheduleError, check_schedules
from megazero.pipeline.schedules import Action, build_all
from megazero.pipeline.zero_bubble import (
    ZERO_BUBBLE,
    all_schedule_steps,
    inflight_limits,
    min_microbatches,
    zero_bubble_schedule,
)


def _check(name, pp, m, forward_only=False):
    placement, vpp = ZERO_BUBBLE[name]
    f = 1.0 / vpp  # a chunk is 1/vpp of a stage: F = B = W per stage, as the paper assumes
    return check_schedules(zero_bubble_schedule(name, pp, m, forward_only), vpp, m,
                           forward_only, f_time=f, b_time=2 * f, w_time=f, placement=placement,
                           inflight_limits=inflight_limits(name, pp, m))


@pytest.mark.parametrize("name", sorted(ZERO_BUBBLE))
def test_every_schedule_is_proven_for_pp_2_to_8_and_m_up_to_4pp(name):
    checked = 0
    for pp in range(2, 9):
        for m in range(min_microbatches(name, pp), 4 * pp + 1):
            res = _check(name, pp, m)
            assert max(res.peak_inflight) <= max(inflight_limits(name, pp, m))
            checked += 1
        _check(name, pp, 2 * pp, forward_only=True)
    assert checked >= 77


def test_bubble_and_memory_against_1f1b():
    """pp 4, m = 2p and 4p, F = B = W: ZB-H1 a third of 1F1B's bubble at 1F1B's peak; ZBV and
    DualPipeV a sixth, ZBV at 1F1B's peak, DualPipeV half a stage above it."""
    for m in (8, 16):
        base = check_schedules(build_all(4, None, m), 1, m)
        bubble = max(base.idle)
        peak = max(base.peak_inflight_stage_equivalents)
        got = {n: _check(n, 4, m) for n in ZERO_BUBBLE}
        ratio = {n: max(r.idle) / bubble for n, r in got.items()}
        mem = {n: max(r.peak_inflight_stage_equivalents) for n, r in got.items()}
        assert ratio["zb-h1"] == pytest.approx(1 / 3) and mem["zb-h1"] == peak
        assert ratio["zbv"] == pytest.approx(1 / 6) and mem["zbv"] == peak
        assert ratio["dualpipev"] == pytest.approx(1 / 6) and mem["dualpipev"] == peak + 0.5


def test_delayed_wgrad_1f1b_keeps_1f1b():
    for pp, m in ((2, 4), (4, 8), (4, 3)):
        steps = all_schedule_steps(pp, None, m, delay_wgrad=True)
        res = check_schedules(steps, 1, m, w_time=1.0)
        base = check_schedules(build_all(pp, None, m), 1, m)
        # the input grad leaves before the W GEMMs: never later than 1F1B, same memory
        assert res.makespan <= base.makespan and res.peak_inflight == base.peak_inflight
        assert res.peak_w_stash == [1] * pp
        for rank in steps:
            kinds = [s[0].kind for s in rank if s[0].is_compute]
            assert kinds.count("W") == m and kinds.count("B") == m


def test_dualpipev_refuses_too_few_microbatches():
    with pytest.raises(ConfigError, match=r"--pipeline-schedule dualpipev needs at least 8 "
                                          r"micro-batches.*got 7"):
        zero_bubble_schedule("dualpipev", 4, 7)


def _replace(steps, rank, old, new):
    out = [list(r) for r in steps]
    out[rank] = [tuple(new if a == old else a for a in s) for s in out[rank]]
    return out


def _compute_index(steps, rank, action):
    return next(i for i, s in enumerate(steps[rank]) if s == (action,))


def test_planted_faults_are_named():
    pp, m, name = 4, 8, "zbv"
    placement, vpp = ZERO_BUBBLE[name]
    steps = [list(r) for r in zero_bubble_schedule(name, pp, m)]
    lim = inflight_limits(name, pp, m)

    def check(s):
        return check_schedules(s, vpp, m, placement=placement, inflight_limits=lim)

    check(steps)
    # a W before its B
    w, b = Action("W", 1, 3), Action("B", 1, 3)
    bad = [list(r) for r in steps]
    i, j = _compute_index(bad, 2, b), _compute_index(bad, 2, w)
    bad[2][i], bad[2][j] = bad[2][j], bad[2][i]
    with pytest.raises(ScheduleError, match=r"rank 2: W3.1 \(step \d+\) runs before its "
                                            r"backward B3.1"):
        check(bad)
    # a missing W
    bad = [list(r) for r in steps]
    del bad[1][_compute_index(bad, 1, Action("W", 0, 5))]
    with pytest.raises(ScheduleError, match=r"rank 1: W5.0 never runs"):
        check(bad)
    # a swapped send: rank 0 sends micro-batch 1's activation to rank 2 instead of rank 1
    s1 = Action("SEND_F", 0, 1, 1)
    bad = _replace(steps, 0, s1, Action("SEND_F", 0, 1, 2))
    with pytest.raises(ScheduleError, match=r"mismatch on channel 0->1 \(F\), message 1: "
                                            r"rank 0 sends sF2.0>1 .* receives it as rF1.0<0"):
        check(bad)
    # the V's self hand-off out of order: the last rank's chunk 1 before its chunk 0
    bad = [list(r) for r in steps]
    f0, f1 = Action("F", 0, 0), Action("F", 1, 0)
    i, j = _compute_index(bad, 3, f0), _compute_index(bad, 3, f1)
    bad[3][i], bad[3][j] = bad[3][j], bad[3][i]
    with pytest.raises(ScheduleError, match=r"rank 3: F 0.1 runs before F 0.0"):
        check(bad)


def test_schedule_grid_tool_prints_the_zero_bubble_schedules(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "schedule_grid.py"
    spec = importlib.util.spec_from_file_location("schedule_grid", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--pp", "4", "--microbatches", "8", "--schedule", "zb-h1"]) == 0
    out = capsys.readouterr().out
    assert "W7.0" in out and "rank 0: busy 24, idle 3 (bubble 0.125)" in out
    assert tool.main(["--pp", "4", "--microbatches", "8", "--schedule", "zbv", "--f-time",
                      "0.5", "--b-time", "1", "--w-time", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "F7.1" in out and "idle 1.5 (bubble 0.062)" in out
    assert tool.main(["--pp", "4", "--microbatches", "6", "--schedule", "dualpipev"]) == 1
    assert "needs at least 8 micro-batches" in capsys.readouterr().err


def test_uneven_split_counts_and_ranges():
    from megazero.config.rules import parse_pipeline_layout, stage_layer_counts
    from megazero.pipeline.partition import ranges_from_counts

    assert stage_layer_counts(5, 2, first=3) == [3, 2]
    assert stage_layer_counts(6, 2, account_embedding=True, account_loss=True) == [3, 3]
    assert stage_layer_counts(10, 4, first=1, last=3) == [1, 3, 3, 3]
    assert parse_pipeline_layout("Et|(t|)*2ttL", 5) == [(1, True, False), (1, False, False),
                                                         (1, False, False), (2, False, True)]
    assert stage_layer_counts(5, 4, layout="E|t*3|t*2|L") == [0, 3, 2, 0]
    assert ranges_from_counts([0, 3, 2, 0], 2) == [[(0, 0), (3, 5)], [(0, 3), (5, 5)]]
    assert ranges_from_counts([0, 3, 2, 0], 2, "v") == [[(0, 0), (5, 5)], [(0, 3), (3, 5)]]
    for stages, kw, msg in [
            (3, dict(first=2), "leave 3 of --num-layers 5 layers for 2 other stages"),
            (4, dict(layout="E|t*3|t|L"), "places 4 transformer layers"),
            (3, dict(layout="t|Et*4|L"), "the embedding E must open the first stage"),
            (2, dict(layout="Et*5|X"), "unknown symbols ['X']"),
            (4, dict(layout="Et*5|L"), "gives 2 stages but the run has 4"),
            (4, dict(account_embedding=True), "= 6 does not split evenly over 4")]:
        with pytest.raises(ConfigError, match=re.escape(msg)):
            stage_layer_counts(5, stages, **kw)
