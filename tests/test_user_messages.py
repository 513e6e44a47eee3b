"""What a new user reads: DeepSpeed blocks that are accepted, switched off or not implemented,
the start-up summary (offload named), the log line's units, and help texts that agree with the
choices they offer."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

from megazero.config import load_config
from megazero.observability.monitor import format_log_line
from megazero.testing.launch import SCRIPT, TINY, check, env, run_training


def _warnings_for(ds: dict, tmp_path) -> list[str]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config([*TINY, "--train-iters", "2", "--deepspeed_config", str(path)], 1)
    return [str(w.message) for w in caught]


def test_monitoring_blocks_warn_only_where_they_have_no_effect(tmp_path):
    # comms_logger acts (megazero/observability/comms_logging.py): no warning, enabled or not
    assert _warnings_for({"comms_logger": {"enabled": True, "verbose": False, "prof_all": True,
                                           "debug": False, "prof_ops": ["all_reduce"]}},
                         tmp_path) == []
    assert _warnings_for({"comms_logger": {"enabled": False}}, tmp_path) == []
    # so does flops_profiler (megazero/observability/flops_profiler.py), but for
    # recompute_fwd_factor: the recomputed forward is counted, not estimated
    assert _warnings_for({"flops_profiler": {"enabled": True, "profile_step": 1}},
                         tmp_path) == []
    said = _warnings_for({"flops_profiler": {"enabled": True, "recompute_fwd_factor": 1.0}},
                         tmp_path)
    assert len(said) == 1 and "'flops_profiler.recompute_fwd_factor'" in said[0], said


def test_startup_summary_names_offload_and_the_save_schedule(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    out = check(run_training([*TINY, "--train-iters", "2", "--eval-iters", "0",
                              "--deepspeed_config", str(path), "--save", str(tmp_path / "ck"),
                              "--save-interval", "10"]))
    assert ("> offload_optimizer: fp32 masters and optimizer moments; the step runs on the "
            "CPU, in host memory (pin_memory true)") in out, out[:2000]
    assert (f"> checkpoints: saving to {tmp_path / 'ck'} every 10 iterations and at the end "
            f"of training") in out
    assert "TFLOP/s per process:" in out and "TFLOP/s per GPU" not in out


def test_log_line_names_the_device_kind():
    args = (1, 10, 8, 100.0, 1e-3, 8, 2.0, None, None, 0, 0, 10.0, 0.5)
    assert "TFLOP/s per GPU: 0.50" in format_log_line(*args, ("peak memory (MB)", 1.0))
    assert "TFLOP/s per process: 0.50" in format_log_line(*args, ("peak RSS (MB)", 1.0))


def test_optimizer_help_names_its_own_choices():
    out = subprocess.run([sys.executable, SCRIPT, "--help"], env=env(), capture_output=True,
                         text=True, timeout=120).stdout
    block = " ".join(out.split("--optimizer {adam,sgd}")[1].split("--sgd-momentum")[0].split())
    assert "adam (default: Adam with decoupled weight decay" in block, block
    assert "adamw" not in block, block


def test_torchruns_failure_report_carries_the_error_line():
    proc = run_training([*TINY, "--train-iters", "2", "--bogus-flag"], nproc=2)
    assert proc.returncode != 0
    root = proc.stderr.split("Root Cause (first observed failure):")[1]
    assert ("traceback : pretrain_gpt.py: error: command line: unknown argument "
            "'--bogus-flag'") in root, proc.stderr[-3000:]
    assert "To enable traceback see" not in proc.stderr


def test_convert_help_explains_loader_and_saver():
    import os

    from megazero.testing.launch import REPO

    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "checkpoint",
                                                       "convert.py"), "--help"],
                         env=env(), capture_output=True, text=True, timeout=120).stdout
    text = " ".join(out.split())
    assert "--loader {hf,megazero} what --load-dir holds" in text, text
    assert "--saver {hf,megazero,torch} what to write" in text, text
