"""--overlap-moe-expert-parallel-comm (combined 1F1B, megazero.combined_1f1b).

- The duet: a forward and a backward take turns exactly at their all-to-alls, the backward
  first, on a fixed order; an error in either pass reaches the caller.
- The schedules: gradient accumulation becomes F0, (F1 B0), ..., B(m-1); the interleaved
  schedule, with one more warm-up forward, pairs its whole steady state at the same
  makespan; DualPipeV compiled with F&B units pairs every steady-state slot, passes the
  schedule checker (no deadlock, messages in order) and costs at most 5% more time in the
  unit-cost simulation (F = B = W), before the pairs' overlap.
- Through the training entry point, runs with the flag train the one-process model (losses,
  grad norms, weights to fp32 rounding) at expert parallel 2 and 4, with ZeRO 1, with ZeRO 2 +
  deferred weight gradients + grouped GEMM + selective recompute, with ZeRO 3 (nothing
  persistent), with TP 2 + SP
  + --tp-comm-overlap, on the interleaved pipeline and on DualPipeV; the DeepSeek-V3 shape
  (MLA, MTP with an MoE layer) trains the same with and without the flag.
- In flight: under the flag every paired all-to-all travels while the other micro-batch
  computes; without it none does. Under the NCCL-rules mode every rank issues the same
  collectives per group in the same order.
- The flag is refused where it has nothing to pair or to hide, naming the fix.
"""

import json
import threading

import pytest

from megazero.combined_1f1b import duet
from megazero.config import ConfigError, load_config
from megazero.pipeline.checker import check_schedules
from megazero.pipeline.combined import combined_steps, pair_count
from megazero.pipeline.schedules import no_pipelining
from megazero.pipeline.zero_bubble import all_schedule_steps, inflight_limits
from megazero.testing import run_distributed
from megazero.testing.schedule_runs import assert_same_run, merge_ranks, runs_world
from megazero.testing.training_runs import TINY

# --- the duet --------------------------------------------------------------------------------


class _Done:
    def wait(self):
        pass


def _pass(name, log, turns):
    def run():
        for i in range(turns):
            log.append(f"{name}{i}")
            duet.exchange(_Done, "test", "alone")
        log.append(f"{name}{turns}")
    return run


def test_the_passes_take_turns_at_their_exchanges_backward_first():
    log = []
    duet.run_pair(_pass("f", log, 3), _pass("b", log, 3))
    assert log == ["b0", "f0", "b1", "f1", "b2", "f2", "b3", "f3"]
    log.clear()  # a pass with fewer exchanges: the other runs on alone once it ends
    duet.run_pair(_pass("f", log, 3), _pass("b", log, 1))
    assert log == ["b0", "f0", "b1", "f1", "f2", "f3"]
    assert duet.current() is None
    log.clear()  # outside a duet an exchange just waits
    _pass("x", log, 2)()
    assert log == ["x0", "x1", "x2"]


def test_the_forward_thread_runs_on_the_callers_cuda_device(monkeypatch):
    """The current CUDA device is per thread (a new one starts on cuda:0): the forward's
    thread is set to the caller's, e.g. rank 3's cuda:3 on an 8-GPU node. CUDA is stood in
    for: the calls the duet makes are recorded."""
    import torch

    set_in: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: set_in.append((threading.current_thread().name, d)))
    duet.run_pair(_pass("f", [], 1), _pass("b", [], 1))
    assert set_in == [("megazero-combined-1f1b-forward", 3)]


def test_an_exchange_is_traced_as_paired_only_while_the_other_pass_runs():
    from megazero.tensor_parallel.overlap import recording

    with recording() as trace:
        duet.run_pair(_pass("f", [], 3), _pass("b", [], 1))
        _pass("x", [], 1)()
    names = [c[0] for c in trace.comms]
    # b's one, f's first (b still running), then f's last two after b ended; then outside
    assert names == ["test", "test", "alone", "alone", "alone"], names


def test_an_error_in_either_pass_reaches_the_caller():
    def bad():
        duet.exchange(_Done, "test", "alone")
        raise ValueError("forward broke")

    with pytest.raises(ValueError, match="forward broke"):
        duet.run_pair(bad, _pass("b", [], 3))
    with pytest.raises(ValueError, match="backward broke"):
        duet.run_pair(_pass("f", [], 3), lambda: (_ for _ in ()).throw(
            ValueError("backward broke")))
    assert duet.current() is None
    # the forward's helper thread has ended in both cases (joined before the error is raised)
    assert not [t for t in threading.enumerate() if t.name.startswith("megazero-combined")]


# --- the schedules ---------------------------------------------------------------------------

def _fmt(steps):
    return " ".join("+".join(str(a) for a in s) for s in steps)


def test_gradient_accumulation_pairs_each_forward_with_the_previous_backward():
    assert _fmt(combined_steps(no_pipelining(4))) == (
        "F0.0 F1.0 B0.0 F2.0 B1.0 F3.0 B2.0 B3.0")
    assert pair_count(combined_steps(no_pipelining(4))) == 3
    assert combined_steps(no_pipelining(1)) == no_pipelining(1)
    fwd_only = no_pipelining(3, forward_only=True)
    assert combined_steps(fwd_only) == fwd_only


@pytest.mark.parametrize("pp,vpp,m,n", [(2, 2, 4, None), (4, 2, 8, None), (4, 2, 16, None),
                                        (2, 3, 6, None), (4, 2, 16, 8), (3, 3, 9, None)])
def test_the_interleaved_schedule_with_one_more_warm_up_forward_pairs_its_steady_state(
        pp, vpp, m, n):
    from megazero.pipeline.schedules import interleaved_warmup

    plain = all_schedule_steps(pp, vpp, m, group_size=n)
    steps = all_schedule_steps(pp, vpp, m, group_size=n, combined=True)
    before = check_schedules(plain, vpp, m, group_size=n)
    after = check_schedules(steps, vpp, m, group_size=n, memory_bound=False)
    assert after.makespan == before.makespan
    for r, s in enumerate(steps):
        steady = vpp * m - min(interleaved_warmup(pp, vpp, m, r, n) + 1, vpp * m)
        assert pair_count(s) == steady, (r, pair_count(s), steady)
    # megatron-core's warm-up: the last rank's loss-chunk forwards meet their own backward
    last = plain[-1]
    own = sum(1 for i in range(len(last) - 1) if last[i][0].kind == "F"
              and last[i + 1][0].kind == "B" and last[i][0].microbatch == last[i + 1][0].microbatch)
    assert own > 0 and pair_count(last) < pair_count(steps[-1])


@pytest.mark.parametrize("pp,m", [(2, 8), (3, 9), (4, 8), (4, 16), (8, 16)])
def test_dualpipev_compiled_with_fb_units_pairs_its_steady_state(pp, m):
    plain = all_schedule_steps(pp, 2, m, schedule="dualpipev")
    steps = all_schedule_steps(pp, 2, m, schedule="dualpipev", combined=True)
    kw = dict(placement="v", inflight_limits=inflight_limits("dualpipev", pp, m), b_time=1.0)
    before = check_schedules(plain, 2, m, **kw)
    after = check_schedules(steps, 2, m, **kw)  # raises on a deadlock or a mismatched message
    assert after.makespan <= 1.05 * before.makespan, (before.makespan, after.makespan)
    for r, s in enumerate(steps):
        # phase 4 (m - 2 pp + r + 1 rounds of two F&B slots) and phase 5 (pp - r - 1 slots)
        assert pair_count(s) >= 2 * (m - 2 * pp + r + 1) + (pp - r - 1), r
    assert [pair_count(s) for s in plain] != [pair_count(s) for s in steps]


# --- training --------------------------------------------------------------------------------

BASE = [*TINY, "--train-iters", "2", "--untie-embeddings-and-output-weights",
        "--global-batch-size", "16"]
MOE = [*BASE, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
       "--moe-shared-expert-intermediate-size", "32", "--moe-token-dispatcher-type", "alltoall",
       "--swiglu", "--disable-bias-linear"]
ON = ["--overlap-moe-expert-parallel-comm"]


def _ep(ep, *extra):
    return [*MOE, "--expert-model-parallel-size", str(ep), *ON, *extra]


LAYOUTS = [
    ("ep4 dp4 (2 micro-batches)", _ep(4)),
    ("ep2 dp4 zero1", _ep(2, "--zero-stage", "1")),
    ("ep2 dp4 zero2 delayed wgrad, grouped GEMM, selective recompute",
     _ep(2, "--zero-stage", "2", "--delay-wgrad-compute", "--moe-grouped-gemm",
         "--recompute-granularity", "selective")),
    ("tp2 sp tp-overlap ep2", _ep(2, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--tp-comm-overlap", "--expert-tensor-parallel-size", "1")),
    ("pp2 interleaved ep2", _ep(2, "--pipeline-model-parallel-size", "2",
                                "--num-layers-per-virtual-pipeline-stage", "1")),
    ("pp2 dualpipev ep2", _ep(2, "--pipeline-model-parallel-size", "2",
                              "--pipeline-schedule", "dualpipev")),
]
# weights come from TP rank 0 only, which at tp 2 x ep 2 x etp 1 holds half of the experts
HALF_EXPERTS = {"tp2 sp tp-overlap ep2"}


def test_combined_1f1b_trains_the_one_process_model(tmp_path):
    """ZeRO-3 with every parameter partitioned (no persistence threshold) and small prefetch
    and live-parameter limits: each module that owns parameters runs its forward, and its
    backward, inside one turn, so the gathers and releases of the two passes never cross
    (losses and grad norms: ZeRO-3's weights are partitioned)."""
    z3 = tmp_path / "zero3.json"
    z3.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 2000, "stage3_max_live_parameters": 5000}}))
    layouts = [*LAYOUTS, ("ep2 dp4 zero3, nothing persistent", _ep(2, "--deepspeed_config",
                                                                      str(z3)))]
    (ref,) = merge_ranks(run_distributed(runs_world, 1, [MOE], timeout=300))
    got = merge_ranks(run_distributed(runs_world, 4, [a for _, a in layouts], timeout=600))
    for (what, _), g in zip(layouts, got):
        assert_same_run(g, ref, what, subset=what in HALF_EXPERTS, weights="zero3" not in what)


def test_the_deepseek_v3_shape_trains_the_same_with_it():
    """Multi-latent attention, group-limited sigmoid routing with the expert bias, a shared
    expert, the sequence-wise balancing loss and an MoE multi-token-prediction layer (whose
    all-to-alls take turns too), at EP 2: the same run with and without the flag."""
    from megazero.testing.deepseek_runs import DEEPSEEK
    from megazero.testing.launch import TINY as LAUNCH_TINY

    args = [*LAUNCH_TINY, *DEEPSEEK, "--moe-token-dispatcher-type", "alltoall",
            "--expert-model-parallel-size", "2", "--eval-iters", "0"]
    plain, combined = merge_ranks(run_distributed(runs_world, 2, [args, [*args, *ON]],
                                                  timeout=300))
    assert_same_run(combined, plain, "DeepSeek-V3 shape, EP 2")


def _in_flight(rank, world, cases):
    import contextlib
    import io

    from megazero.tensor_parallel.overlap import recording
    from megazero.testing.training_runs import train_in_rank

    out = {}
    for name, args in cases:
        with contextlib.redirect_stdout(io.StringIO()), recording() as trace:
            train_in_rank(rank, world, args)
        shares: dict[str, list[float]] = {}
        for op, share in trace.hidden_shares():
            shares.setdefault(op, []).append(share)
        out[name] = shares
    return out


def test_paired_all_to_alls_travel_under_the_other_micro_batch():
    """EP 2 on 2 ranks, 4 micro-batches a step: with the flag, the all-to-alls of the paired
    passes (3 pairs a step) are each in flight while the other micro-batch computes; those of
    the first forward and the last backward, which run alone, and all of them without the
    flag, are waited for at once."""
    cases = [("plain", [*MOE, "--expert-model-parallel-size", "2"]), ("combined", _ep(2))]
    results = run_distributed(_in_flight, 2, cases, nccl_rules=True, timeout=300)
    for res in results:
        plain, comb = res["plain"], res["combined"]
        assert set(plain) == {"ep_all_to_all"}, plain
        assert all(v == 0.0 for v in plain["ep_all_to_all"]), plain
        assert set(comb) == {"ep_all_to_all", "ep_a2a_forward", "ep_a2a_backward"}, comb
        # 4 layers x (dispatch + combine) per pass; 3 pairs per step, 2 steps
        assert len(comb["ep_a2a_forward"]) == len(comb["ep_a2a_backward"]) == 2 * 3 * 8
        assert all(v > 0.0 for k in ("ep_a2a_forward", "ep_a2a_backward") for v in comb[k]), comb
        assert len(comb["ep_all_to_all"]) == 2 * 2 * 8  # F0 and B3 alone
        assert all(v == 0.0 for v in comb["ep_all_to_all"])


# --- the flag's checks -----------------------------------------------------------------------

@pytest.mark.parametrize("extra,world,message", [
    (["--expert-model-parallel-size", "1"], 2, "--expert-model-parallel-size > 1"),
    (["--moe-token-dispatcher-type", "allgather"], 2, "--moe-token-dispatcher-type alltoall"),
    (["--moe-shared-expert-overlap"], 2, "drop --moe-shared-expert-overlap"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], 2,
     "a recomputed forward would run inside the other micro-batch's turn"),
    (["--pipeline-model-parallel-size", "2"], 4, "--num-layers-per-virtual-pipeline-stage N"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"], 4,
     "--pipeline-schedule dualpipev instead of zbv"),
])
def test_the_flag_is_refused_where_it_cannot_pair(extra, world, message):
    args = [*MOE, "--expert-model-parallel-size", "2", *ON, *extra]
    with pytest.raises(ConfigError, match="--overlap-moe-expert-parallel-comm") as err:
        load_config(args, world)
    assert message in str(err.value)
    assert load_config([*MOE, "--expert-model-parallel-size", "2", *ON], 2)
