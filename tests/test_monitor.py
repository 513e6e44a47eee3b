"""Log line, TensorBoard tags, csv/json sinks, wandb fallback, timers and the FLOPs formula."""

import json
import re
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megazero.config import LoggingConfig, ModelConfig
from megazero.observability.flops import (
    gpt_flops_per_iteration,
    mfu,
    model_flops_per_iteration,
    peak_flops,
    tflops_per_device,
)
from megazero.observability.monitor import (
    TB_TAGS,
    Monitor,
    Timers,
    breakdown_scalars,
    format_breakdown,
    format_log_line,
    peak_memory,
)


def test_log_line_format():
    line = format_log_line(10, 100, 160, 123.44, 3e-4, 16, 5.1234564, 65536.0, 1.2345, 0, 0,
                           1234.5, 0.0123, ("peak memory (MB)", 123.44),
                           {"forward-backward": 100.0})
    assert line == (
        " iteration       10/     100 | consumed samples:          160 | elapsed time per "
        "iteration (ms): 123.4 | learning rate: 3.000000E-04 | global batch size:    16 | "
        "lm loss: 5.123456E+00 | loss scale: 65536.0 | grad norm: 1.234 | number of skipped "
        "iterations:   0 | number of nan iterations:   0 | tokens per second: 1234.5 | "
        "TFLOP/s per GPU: 0.01 | peak memory (MB): 123.4 | forward-backward (ms): 100.0 |")
    assert float(re.search(r"lm loss: (\S+) \|", line).group(1)) == pytest.approx(5.123456)
    with_mfu = format_log_line(1, 1, 8, 1.0, 1e-3, 8, 1.0, None, None, 0, 0, 1.0, 494.5,
                               ("peak memory (MB)", 1.0), None, 0.5)
    assert "| TFLOP/s per GPU: 494.50 | MFU: 50.0% | peak memory (MB): 1.0 |" in with_mfu


def test_peak_memory_on_cpu_is_labelled_rss():
    label, mb = peak_memory()
    assert label == "peak RSS (MB)"
    assert 10 < mb < 100_000


def test_tensorboard_csv_json_sinks(tmp_path, capsys):
    cfg = LoggingConfig(log_interval=2, tensorboard_dir=str(tmp_path / "tb"),
                        tensorboard_job_name="job",
                        csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv"),
                                     "job_name": "run"})
    mon = Monitor(cfg, enabled=True, log_json=str(tmp_path / "m.jsonl"))
    losses = [4.0, 3.0, 2.5, 2.0, 1.5, 1.0]
    logged = []
    for it, loss in enumerate(losses, start=1):
        mon.record(loss, skipped=False, seconds=0.1)
        if it % 2 == 0:
            mon.report(it, 6, it * 8, 1e-3 * it, 8, 16, 1024.0, 0.5 * it, 1e9, 2, 1e9)
            logged.append(it)
    mon.report_validation(6, 1.25)
    mon.close()
    out = capsys.readouterr().out
    assert out.count("lm loss:") == 3
    assert "lm loss: 3.500000E+00" in out  # mean over the interval (4 + 3) / 2
    assert "lm loss PPL: 3.490343E+00" in out  # exp(1.25)
    acc = EventAccumulator(str(tmp_path / "tb" / "job"))
    acc.Reload()
    assert set(TB_TAGS) <= set(acc.Tags()["scalars"])
    for tag in set(TB_TAGS) - {"lm loss validation"}:
        assert [e.step for e in acc.Scalars(tag)] == logged
    assert [e.value for e in acc.Scalars("lm loss")] == pytest.approx([3.5, 2.25, 1.25])
    assert [e.value for e in acc.Scalars("grad-norm")] == pytest.approx([1.0, 2.0, 3.0])
    assert [(e.step, e.value) for e in acc.Scalars("lm loss validation")] == [(6, 1.25)]
    rows = (tmp_path / "csv" / "run" / "lm_loss.csv").read_text().splitlines()
    assert rows == ["step,lm loss", "2,3.5", "4,2.25", "6,1.25"]
    recs = [json.loads(r) for r in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in recs] == [2, 4, 6, 6]
    assert recs[1]["lm loss"] == 2.25 and recs[1]["consumed_samples"] == 32
    # 1e9 FLOPs in 0.1 s on 2 devices of 1e9 peak: 5e9 FLOP/s per device = 5x the peak
    assert recs[1]["mfu"] == pytest.approx(5.0)


def test_wandb_missing_warns_once_and_continues(tmp_path):
    cfg = LoggingConfig(wandb={"enabled": True, "project": "p"})
    with pytest.warns(UserWarning, match="wandb package is not installed"):
        mon = Monitor(cfg, enabled=True)
    mon.record(1.0, False, 0.01)
    mon.report(1, 1, 1, 1e-3, 1, 4, None, None, 0.0, 1)
    mon.close()


def test_disabled_monitor_writes_nothing(tmp_path, capsys):
    mon = Monitor(LoggingConfig(tensorboard_dir=str(tmp_path / "tb")), enabled=False)
    mon.record(1.0, False, 0.01)
    mon.report(1, 1, 1, 1e-3, 1, 4, None, None, 0.0, 1)
    assert capsys.readouterr().out == "" and not (tmp_path / "tb").exists()


def test_timers_and_nan_counting(capsys):
    t = Timers()
    t.start("optimizer")
    time.sleep(0.02)
    t.stop("optimizer")
    times = t.pop_all()
    assert 0.015 < times["optimizer"] < 1.0 and t.pop_all() == {}
    mon = Monitor(LoggingConfig(wall_clock_breakdown=True), enabled=True)
    mon.record(float("nan"), False, 0.1)
    mon.record(None, True, 0.1)
    mon.record(2.0, False, 0.1, {"optimizer": 0.05})
    mon.report(3, 3, 3, 1e-3, 1, 4, 8.0, 1.0, 0.0, 1)
    out = capsys.readouterr().out
    assert "number of skipped iterations:   1" in out and "number of nan iterations:   1" in out
    assert "lm loss: 2.000000E+00" in out
    assert re.search(r"time breakdown \(ms per iteration\): loop [\d.]+ = optimizer 16\.7 ", out)


def test_timer_regions_are_exclusive_and_add_up():
    """A region opened inside another pauses it: each second is charged to the innermost open
    region, and the parts add up to the outer wall time."""
    t = Timers()
    marks = []

    def work(seconds: float) -> None:
        t0 = time.perf_counter()
        time.sleep(seconds)
        marks.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    with t.region("backward"):
        work(0.02)
        with t.region("forward"):
            work(0.03)
            with t.region("comm dp/all_reduce"):
                work(0.01)
        work(0.02)
        t.start("left open")  # closed by its enclosing region's stop
        work(0.01)
    with t.paused(), t.region("ignored"):
        time.sleep(0.01)
    got = t.pop_all()
    wall = time.perf_counter() - t0
    assert set(got) == {"backward", "forward", "comm dp/all_reduce", "left open"}
    slack = 0.004  # clock reads between the marks and the region boundaries
    assert got["backward"] == pytest.approx(marks[0] + marks[3], abs=slack)
    assert got["forward"] == pytest.approx(marks[1], abs=slack)
    assert got["comm dp/all_reduce"] == pytest.approx(marks[2], abs=slack)
    assert got["left open"] == pytest.approx(marks[4], abs=slack)
    assert sum(got.values()) == pytest.approx(sum(marks), abs=slack)
    assert sum(got.values()) < wall - 0.009  # the paused stretch is nobody's
    t.add_overlapped("comm dp/all_gather in flight", 0.5)
    assert t.pop_overlapped() == {"comm dp/all_gather in flight": 0.5}
    assert t.pop_overlapped() == {} and t.pop_all() == {}


def test_breakdown_line_and_scalars():
    line = format_breakdown({"forward": 40.0, "backward": 80.0, "comm dp/all_reduce wait": 5.0},
                            130.0, {"comm dp/all_reduce in flight": 30.0})
    assert line == (" time breakdown (ms per iteration): loop 130.0 = backward 80.0 + forward "
                    "40.0 + comm dp/all_reduce wait 5.0 (96.2% accounted) | in flight beside "
                    "them: comm dp/all_reduce 30.0")
    sc = breakdown_scalars({"forward": 40.0, "backward": 80.0}, 125.0, {})
    assert sc == {"time/forward_ms": 40.0, "time/backward_ms": 80.0, "time/loop_ms": 125.0,
                  "time/accounted": 0.96}


def test_flops_formula_hand_computed():
    # B=8, s=1024, l=24, h=2048, V=50304: 72*8*1024*24*2048^2 * (1 + 1024/12288 + 50304/589824)
    f = model_flops_per_iteration(8, 1024, 24, 2048, 50304)
    base = 72 * 8 * 1024 * 24 * 2048**2
    assert f == pytest.approx(base * (1 + 1024 / 12288 + 50304 / 589824))
    assert f == pytest.approx(6.93852e13, rel=1e-5)  # 5.9373e13 * 1.168620
    # Counted GEMM by GEMM, a GPT-2-shaped model gives the closed form exactly.
    gpt = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=1024,
                      vocab_size=50304)
    assert gpt_flops_per_iteration(gpt, 8) == pytest.approx(f, rel=1e-12)
    assert tflops_per_device(1e15, 2.0, 4) == pytest.approx(125.0)
    assert peak_flops("NVIDIA H100 80GB HBM3", True) == 989e12
    assert peak_flops("cpu", False) is None
    assert mfu(989e12, 1.0, 2, 989e12) == pytest.approx(0.5)
    assert mfu(1.0, 1.0, 1, None) is None


def test_flops_count_grouped_query_attention_swiglu_and_untied_head():
    # Llama-style 1.5B: h 2048, 32 heads in 8 KV groups, SwiGLU ffn 8192, vocab 128256.
    h, s, layers, ffn, vocab, b = 2048, 2048, 16, 8192, 128256, 8
    cfg = ModelConfig.preset("llama", num_layers=layers, hidden_size=h, num_attention_heads=32,
                             num_query_groups=8, ffn_hidden_size=ffn, seq_length=s,
                             vocab_size=vocab)
    # Megatron's num_floating_point_operations, written out for these settings.
    expected = 12 * b * s * layers * h * h * (
        (1 + 8 / 32 + s / h) + (ffn / h) * 1.5 + vocab / (2 * layers * h))
    assert gpt_flops_per_iteration(cfg, b) == pytest.approx(expected, rel=1e-12)
    # The GPT-2 closed form overcounts K/V (groups) and undercounts the gate matrix.
    closed = model_flops_per_iteration(b, s, layers, h, vocab)
    assert gpt_flops_per_iteration(cfg, b) / closed == pytest.approx(10.2070 / 8.9569, rel=1e-4)
