"""Pipeline schedules as data: proved by the checker's simulation, no processes."""

import pytest

from megazero.config import ConfigError, valid_microbatch_group_sizes
from megazero.pipeline.checker import ScheduleError, check_schedules, render_grid
from megazero.pipeline.schedules import (
    Action,
    build_all,
    build_schedule,
    interleaved_order,
    one_f_one_b,
)


def counts(pp):
    """pp, 2pp, 4pp, and one count that is not a multiple of pp (when pp > 1)."""
    return sorted({pp, 2 * pp, 4 * pp} | ({2 * pp + 1} if pp > 1 else {3}))


CASES = [(pp, vpp, m) for pp in range(1, 9) for vpp in (1, 2, 4) for m in counts(pp)
         if not (pp == 1 and vpp > 1)]


@pytest.mark.parametrize("pp,vpp,m", CASES)
def test_schedules_are_correct(pp, vpp, m):
    if vpp > 1 and m % pp:  # 2pp + 1 in groups of pp leaves a last group of one
        with pytest.raises(ConfigError) as err:
            build_all(pp, vpp, m)
        msg = str(err.value)
        assert f"{m} (--global-batch-size" in msg and "leave a last group of 1" in msg
        valid = ", ".join(map(str, valid_microbatch_group_sizes(pp, m)))
        assert f"--microbatch-group-size-per-virtual-pipeline-stage to one of {valid}" in msg
        return
    for forward_only in (False, True):
        scheds = build_all(pp, vpp, m, forward_only)
        res = check_schedules(scheds, vpp, m, forward_only)
        computes = [a for steps in scheds for s in steps for a in s if a.is_compute]
        assert len(computes) == pp * vpp * m * (1 if forward_only else 2)
    # the bubble of the simulated timeline (F = 1, B = 2 per chunk, free communication)
    res = check_schedules(build_all(pp, vpp, m), vpp, m, f_time=1.0 / vpp, b_time=2.0 / vpp)
    for r in range(pp):
        assert res.busy[r] == pytest.approx(3.0 * m)
        if m % pp == 0:
            assert res.bubble_fraction[r] == pytest.approx((pp - 1) / (vpp * m))
        else:  # 1F1B with m not a multiple of pp: bubble is still (p-1)/m
            assert res.bubble_fraction[r] == pytest.approx((pp - 1) / m)


@pytest.mark.parametrize("pp", range(2, 9))
def test_peak_inflight_1f1b_is_pp_not_m(pp):
    for m in (pp, 2 * pp, 4 * pp):
        res = check_schedules(build_all(pp, 1, m), 1, m)
        assert res.peak_inflight == [min(pp - r, m) for r in range(pp)]
    # all-forward-all-backward (GPipe order) holds every micro-batch
    m = 4 * pp
    gpipe = [[(Action("F", 0, mb),) for mb in range(m)] + [(Action("B", 0, mb),)
             for mb in range(m)]]
    assert check_schedules(gpipe, 1, m, memory_bound=False).peak_inflight == [m]
    with pytest.raises(ScheduleError, match=f"rank 0 holds {m} chunk-micro-batches in flight"):
        check_schedules(gpipe, 1, m)


def _one_f_one_b_pp2(warmup0: int, m: int = 4):
    """1F1B on two stages, with ``warmup0`` warm-up forwards on the first (1F1B: one)."""
    r0 = []
    for mb in range(warmup0):
        r0 += [(Action("F", 0, mb),), (Action("SEND_F", 0, mb, 1),)]
    for i in range(m - warmup0):
        r0 += [(Action("F", 0, warmup0 + i),),
               (Action("SEND_F", 0, warmup0 + i, 1), Action("RECV_B", 0, i, 1)),
               (Action("B", 0, i),)]
    for mb in range(m - warmup0, m):
        r0 += [(Action("RECV_B", 0, mb, 1),), (Action("B", 0, mb),)]
    r1 = [(Action("RECV_F", 0, 0, 0),)]
    for mb in range(m):
        r1 += [(Action("F", 0, mb),), (Action("B", 0, mb),)]
        r1.append((Action("SEND_B", 0, mb, 0),) + ((Action("RECV_F", 0, mb + 1, 0),)
                                                    if mb + 1 < m else ()))
    return [r0, r1]


def test_checker_rejects_an_extra_warmup_forward():
    assert _one_f_one_b_pp2(1) == build_all(2, 1, 4)  # the helper builds real 1F1B
    extra = _one_f_one_b_pp2(2)
    res = check_schedules(extra, 1, 4, memory_bound=False)  # correct and deadlock-free...
    assert res.peak_inflight == [3, 1]
    with pytest.raises(ScheduleError, match="rank 0 holds 3 chunk-micro-batches in flight, more "
                                            "than the schedule's bound of 2"):
        check_schedules(extra, 1, 4)  # ...but holds one micro-batch more than 1F1B may


@pytest.mark.parametrize("pp,vpp", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_peak_inflight_interleaved_matches_megatron_factor(pp, vpp):
    m = 4 * pp
    res = check_schedules(build_all(pp, vpp, m), vpp, m)
    # first stage: 2(p-1) + (v-1)p warm-up chunk-forwards + 1 in steady state
    assert res.peak_inflight[0] == 2 * (pp - 1) + (vpp - 1) * pp + 1
    # in units of a full stage's micro-batch, relative to 1F1B's p: 1 + (p-1)/(p v)
    factor = res.peak_inflight_stage_equivalents[0] / pp
    assert factor == pytest.approx(1 + (pp - 1) / (pp * vpp))


# --- interleaved micro-batch groups (megatron-core's microbatch_group_size_per_vp_stage) -------

GROUP_GRID = [(pp, vpp, m, n) for pp in (2, 3, 4) for vpp in (2, 3)
              for m in range(pp, 3 * pp + 1) for n in valid_microbatch_group_sizes(pp, m)]


def _megatron_core_computes(pp, vpp, m, n, rank):
    """Rank ``rank``'s compute order as megatron-core 0.16 runs it: its schedule table (groups of
    n micro-batches through every chunk, the last group whatever is left), warm-up forwards,
    then one forward and one backward per iteration, then the remaining backwards."""
    table = []
    for start in range(0, m, n):
        end = m if start + n >= m else start + n
        table += [(mb, c) for c in range(vpp) for mb in range(start, end)]
    total = len(table)
    warmup = min(2 * (pp - rank - 1) + (vpp - 1) * n, total)
    fwd = [f"F{mb}.{c}" for mb, c in table]
    bwd = [f"B{mb}.{vpp - 1 - c}" for mb, c in table]
    out = fwd[:warmup]
    for k in range(total - warmup):
        out += [fwd[warmup + k], bwd[k]]
    return out + bwd[total - warmup:]


def _forwards_before_first_backward(steps) -> int:
    computes = [a.kind for s in steps for a in s if a.is_compute]
    return computes.index("B")


def test_group_grid_is_proved_with_megatron_core_counts():
    """Every valid (pp, vpp, M, N) with pp 2..4, vpp 2..3, M pp..3pp: the checker proves the
    training and the forward-only schedule (work, matching, no deadlock under batched
    rendezvous exchanges, in-flight and receive-buffer bounds); the warm-up is megatron-core's
    ``2(pp - r - 1) + (vpp - 1)N`` capped at vpp M; the bubble is (p-1)/(v m)."""
    assert len(GROUP_GRID) == 86
    assert (4, 2, 6, 6) in GROUP_GRID and (4, 2, 10, 5) in GROUP_GRID and (2, 2, 3, 3) in GROUP_GRID
    for pp, vpp, m, n in GROUP_GRID:
        scheds = build_all(pp, vpp, m, group_size=n)
        res = check_schedules(scheds, vpp, m, f_time=1.0 / vpp, b_time=2.0 / vpp, group_size=n)
        check_schedules(build_all(pp, vpp, m, True, n), vpp, m, True, group_size=n)
        for r in range(pp):
            warmup = min(2 * (pp - r - 1) + (vpp - 1) * n, vpp * m)
            computes = [str(a) for st in scheds[r] for a in st if a.is_compute]
            assert computes == _megatron_core_computes(pp, vpp, m, n, r), (pp, vpp, m, n, r)
            # the warm-up, then (if any is left) the steady state's first forward
            assert _forwards_before_first_backward(scheds[r]) == min(warmup + 1, vpp * m)
            assert res.peak_inflight[r] == min(warmup + 1, vpp * m), (pp, vpp, m, n, r)
            assert res.bubble_fraction[r] == pytest.approx((pp - 1) / (vpp * m))
        # the first rank keeps up to N - pp + 1 activations that came round the ring, the last
        # rank as many grads; the others one of each
        assert res.peak_recv_buffers[0][0] == n - pp + 1
        assert res.peak_recv_buffers[pp - 1][1] == n - pp + 1
        assert all(res.peak_recv_buffers[r] == (1, 1) for r in range(1, pp - 1))


def test_invalid_group_sizes_are_refused():
    for pp in (2, 3, 4):
        for m in range(1, 3 * pp + 1):
            for n in range(1, 3 * pp + 2):
                # megatron-core's two checks: pp <= N <= M; last group 0 or >= pp
                if pp <= n <= m and (m % n == 0 or m % n >= pp):
                    assert n in valid_microbatch_group_sizes(pp, m)
                    build_all(pp, 2, m, group_size=n)
                    continue
                with pytest.raises(ConfigError, match="interleaved|microbatch-group-size"):
                    build_all(pp, 2, m, group_size=n)
    assert valid_microbatch_group_sizes(4, 6) == [6]
    assert valid_microbatch_group_sizes(4, 10) == [5, 6, 10]
    assert valid_microbatch_group_sizes(4, 8) == [4, 8]


def test_group_order_matches_megatron_core_table():
    """megatron-core's documented table for PP2 N3 M5 VP2 (get_schedule_table)."""
    order = interleaved_order(2, 2, 5, 3)
    assert [mb for mb, _ in order] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in order] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_one_group_keeps_fewer_in_flight_on_later_ranks():
    """M == pp: rank r runs min(2(pp-r-1) + (vpp-1)pp, vpp pp) warm-up forwards (megatron-core),
    not all vpp pp of them as older Megatron did; the last rank holds (vpp-1)pp + 1."""
    res = check_schedules(build_all(4, 2, 4), 2, 4)
    assert res.peak_inflight == [8, 8, 7, 5]


def _receive_just_in_time(scheds, pp):
    """The leading rank posts each activation receive in the exchange right before the forward
    that consumes it, instead of aligned with the last rank's send."""
    r0 = [tuple(a for a in s if a.kind != "RECV_F") for s in scheds[0]]
    out: list = []
    for step in r0:
        if step and step[0].kind == "F" and step[0].chunk > 0:
            recv = Action("RECV_F", step[0].chunk, step[0].microbatch, pp - 1)
            out[-1] = out[-1] + (recv,)
        if step:
            out.append(step)
    return [out] + scheds[1:]


def test_leading_rank_receives_must_be_aligned():
    """Why rank 0 receives round-the-ring activations early: just in time, the last rank's
    send waits for it (longer makespan) and, for N >= 2pp, the ring deadlocks."""
    pp, vpp = 2, 2
    good = check_schedules(build_all(pp, vpp, 3, group_size=3), vpp, 3, group_size=3)
    late = check_schedules(_receive_just_in_time(build_all(pp, vpp, 3, group_size=3), pp),
                           vpp, 3, group_size=3)
    assert (good.makespan, late.makespan) == (21.0, 24.0)
    # with N = pp it is the same schedule
    same = build_all(pp, vpp, 4)

    def as_sets(scheds):  # a step's actions are posted together: their order is immaterial
        return [[frozenset(s) for s in steps] for steps in scheds]

    assert as_sets(_receive_just_in_time(same, pp)) == as_sets(same)
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedules(_receive_just_in_time(build_all(pp, vpp, 4, group_size=4), pp), vpp, 4,
                        group_size=4)


def test_checker_bounds_receive_buffers():
    """Posting each of rank 0's activation receives one exchange earlier is still correct and
    deadlock-free, but needs one more receive buffer than the group size allows."""
    scheds = build_all(2, 2, 3, group_size=3)
    r0 = [list(s) for s in scheds[0]]
    comm = [i for i, s in enumerate(r0) if not s[0].is_compute]
    for before, at in zip(comm, comm[1:]):
        for a in [a for a in r0[at] if a.kind == "RECV_F"]:
            r0[at].remove(a)
            r0[before].append(a)
    early = [[tuple(s) for s in r0 if s]] + scheds[1:]
    res = check_schedules(early, 2, 3, memory_bound=False)
    assert res.peak_recv_buffers == [(3, 1), (1, 2)]
    with pytest.raises(ScheduleError, match="rank 0 holds 3 received activations before their "
                                            "compute, more than the 2 receive buffer"):
        check_schedules(early, 2, 3, group_size=3)


def test_checker_matches_messages_without_tags():
    """pp = 2 with interleaving: activations and grads share a pair of ranks. Posting a grad send
    in its own exchange before the activation send is right with tags (gloo) but would swap the
    two tensors on a backend that matches per peer in posting order (NCCL)."""
    scheds = build_all(2, 2, 4)
    step = scheds[0][10]
    assert sorted(a.kind for a in step) == ["RECV_B", "SEND_B", "SEND_F"]
    grad_first = [list(s) for s in scheds]
    grad_first[0][10:11] = [tuple(a for a in step if a.kind == "SEND_B"),
                            tuple(a for a in step if a.kind != "SEND_B")]
    with pytest.raises(ScheduleError, match=r"ranks 0->1 without tags, message 4: rank 0 sends "
                                            r"sB0.1>1 \(step 10\) but rank 1 receives rF2.0<0"):
        check_schedules(grad_first, 2, 4)


def test_no_pipelining_and_dispatch():
    steps = build_schedule(1, None, 3, 0)
    assert [str(s[0]) for s in steps] == ["F0.0", "B0.0", "F1.0", "B1.0", "F2.0", "B2.0"]
    assert build_schedule(3, 1, 4, 1) == one_f_one_b(3, 4, 1)
    with pytest.raises(ConfigError, match="needs pp > 1"):
        build_schedule(1, 2, 4, 0)
    with pytest.raises(ConfigError, match="num_microbatches must be a positive integer"):
        build_schedule(2, 1, 0, 0)


def test_1f1b_steady_state_uses_batched_pairs():
    steps = one_f_one_b(4, 8, 1)
    pairs = [tuple(a.kind for a in s) for s in steps if len(s) == 2]
    assert ("SEND_F", "RECV_B") in pairs and ("SEND_B", "RECV_F") in pairs


# --- the checker must be able to fail ---------------------------------------------------------

def _drop(scheds, rank, kind):
    """Remove the first action of ``kind`` from ``rank``'s schedule."""
    out = [list(s) for s in scheds]
    for i, step in enumerate(out[rank]):
        keep = tuple(a for a in step if a.kind != kind)
        if len(keep) != len(step):
            # drop only the first matching action
            removed = next(a for a in step if a.kind == kind)
            keep = tuple(a for a in step if a is not removed)
            out[rank][i:i + 1] = [keep] if keep else []
            return out
    raise AssertionError("nothing to drop")


def test_checker_reports_missing_receive():
    scheds = build_all(2, 1, 4)
    broken = _drop(scheds, 1, "RECV_F")
    with pytest.raises(ScheduleError, match="missing RECV_F 0.0"):
        check_schedules(broken, 1, 4)


def test_checker_reports_unmatched_message():
    scheds = build_all(3, 1, 3)
    # rank 2 listens to rank 0 instead of rank 1 for its first activation
    r2 = [tuple(Action(a.kind, a.chunk, a.microbatch, 0) if (a.kind, a.microbatch) ==
                ("RECV_F", 0) else a for a in s) for s in scheds[2]]
    expected = r"unmatched receive on channel 0->2 \(F\): rank 2 step 0 rF0.0<0 has no match"
    with pytest.raises(ScheduleError, match=expected):
        check_schedules([scheds[0], scheds[1], r2], 1, 3)


def test_checker_reports_mismatched_slots():
    scheds = build_all(2, 1, 2)
    # rank 1 receives micro-batches 1 and 0 in swapped order
    r1 = [list(s) for s in scheds][1]
    recvs = [i for i, s in enumerate(r1) if s[0].kind == "RECV_F" and len(s) == 1]
    assert len(recvs) >= 1
    swapped = []
    for s in r1:
        swapped.append(tuple(Action(a.kind, a.chunk, 1 - a.microbatch, a.peer)
                             if a.kind == "RECV_F" else a for a in s))
    scheds[1] = swapped
    with pytest.raises(ScheduleError, match="mismatch|before|missing"):
        check_schedules(scheds, 1, 2)


def test_checker_reports_deadlock_with_swapped_order():
    # rank 1 waits for a grad before it sends the activation the last stage needs: a cycle
    scheds = build_all(2, 1, 1)
    r0 = scheds[0]
    assert [str(a) for s in r0 for a in s] == ["F0.0", "sF0.0>1", "rB0.0<1", "B0.0"]
    scheds[0] = [r0[0], r0[2], r0[1], r0[3]]
    with pytest.raises(ScheduleError) as err:
        check_schedules(scheds, 1, 1)
    msg = str(err.value)
    assert "deadlock" in msg and "rank 0 at step 1 waits for: rB0.0<1" in msg
    assert "rank 1 at step 0 waits for: rF0.0<0" in msg


def test_checker_reports_rendezvous_deadlock_of_unbatched_ring():
    """Interleaved forwards with separate send and receive steps deadlock on the ring: the
    batched send/recv pairs are what make the real schedule safe."""
    pp, vpp, m = 2, 2, 2
    unbatched = []
    for steps in build_all(pp, vpp, m, forward_only=True):
        flat = []
        for s in steps:
            flat.extend((a,) for a in s)
        # post each chunk's receive just before its forward, sends right after
        unbatched.append(flat)
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedules(unbatched, vpp, m, forward_only=True)


def test_checker_reports_missing_and_duplicate_work():
    scheds = build_all(2, 1, 2)
    no_b = [[s for s in scheds[0] if str(s[0]) != "B1.0"], scheds[1]]
    with pytest.raises(ScheduleError, match="backward B1.0 never runs"):
        check_schedules(no_b, 1, 2)
    dup = [scheds[0] + [(Action("F", 0, 0),)], scheds[1]]
    with pytest.raises(ScheduleError, match="appears twice"):
        check_schedules(dup, 1, 2)


def test_grid_renders_every_action():
    res = check_schedules(build_all(4, 2, 8), 2, 8)
    grid = render_grid(res)
    assert "F3.1" in grid and "B7.0" in grid
    assert grid.count("\n") >= 4 + 4


def _grid_tool():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "schedule_grid.py"
    spec = importlib.util.spec_from_file_location("schedule_grid", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_schedule_grid_tool(capsys):
    tool = _grid_tool()
    assert tool.main(["--pp", "4", "--vpp", "2", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "F3.1" in out and "rank 0: busy 48, idle 9 (bubble 0.188)" in out
    assert "formula bubble (p-1)/(v*m) = 0.188" in out
    assert tool.main(["--pp", "4", "--vpp", "2", "--microbatches", "6"]) == 1
    err = capsys.readouterr().err
    assert "leave a last group of 2" in err and "to one of 6," in err
    assert tool.main(["--pp", "4", "--vpp", "2", "--microbatches", "6", "--group-size", "6"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: busy 36, idle 9 (bubble 0.250)" in out and "F5.1" in out
    assert "peak in-flight 12 chunk-micro-batches, receive buffers 3 activations 1 grads" in out
