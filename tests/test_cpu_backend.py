"""The CPU suite picks gloo explicitly wherever it starts ranks in another process, so that
``python -m pytest tests`` also passes on a GPU machine (where the default backend is NCCL and
a CPU test's ranks would all start on GPU 0, or the run would compare GPU numbers with CPU
references). In-process worlds (megazero.testing.run_distributed) pass gloo themselves."""

import ast
import os
import re

import pytest

from megazero.testing import launch

TESTS = os.path.dirname(os.path.abspath(__file__))
# GPU tests choose the GPU's default (NCCL) on purpose.
GPU_SUITES = {"test_gpu.py"}
# a command list holding one of these starts ranks (or a run that may init a process group)
LAUNCHER_NAMES = {"TORCHRUN", "SCRIPT"}
LAUNCHER_STRINGS = ("torch.distributed.run", "torchrun", "generate_text.py",
                    "finetune_engine.py")


def _launches(tree) -> list[int]:
    """Lines of command lists (``[TORCHRUN, ...]``, ``[sys.executable, "-m",
    "torch.distributed.run", ...]``) in a test module."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.List):
            continue
        for elt in node.elts:
            if isinstance(elt, ast.Name) and elt.id in LAUNCHER_NAMES or \
                    isinstance(elt, ast.Constant) and isinstance(elt.value, str) and \
                    elt.value.endswith(LAUNCHER_STRINGS):
                out.append(node.lineno)
                break
            if isinstance(elt, ast.Call) and any(  # os.path.join(repo, "tools", "x.py")
                    isinstance(a, ast.Constant) and isinstance(a.value, str)
                    and a.value.endswith(LAUNCHER_STRINGS) for a in elt.args):
                out.append(node.lineno)
                break
    return out


def _sources():
    for name in sorted(os.listdir(TESTS)):
        if name.startswith("test_") and name.endswith(".py") and name not in GPU_SUITES:
            with open(os.path.join(TESTS, name), encoding="utf-8") as f:
                yield name, f.read()


def test_run_training_needs_the_backend_spelled_out(monkeypatch):
    ran = []
    monkeypatch.setattr(launch.subprocess, "run", lambda cmd, **kw: ran.append(cmd))
    with pytest.raises(ValueError, match="--distributed-backend explicitly"):
        launch.run_training(["--mock-data", "--train-iters", "1"], nproc=2)
    assert ran == []
    launch.run_training(launch.TINY, nproc=2)
    assert ran and ran[0][-2:] == ["--distributed-backend", "gloo"]


def test_every_subprocess_launch_in_the_cpu_suite_names_gloo():
    """A file that builds a torchrun / pretrain_gpt.py / tool command, or a script that
    initialises torch.distributed, spells out gloo: in the command, its flag list (launch.TINY
    carries it), or the init call."""
    offenders = []
    for name, src in _sources():
        tree = ast.parse(src)
        for node in ast.walk(tree):
            # scripts written by a test: every init call names gloo
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for line in node.value.splitlines():
                    if re.search(r"init_distributed\(|init_process_group\(", line) and \
                            "gloo" not in line:
                        offenders.append(f"{name}: script line {line.strip()!r}")
        launches = _launches(tree)
        if launches and not re.search(r"""["']gloo["']|from megazero\.testing\.launch import """
                                      r"""\(?[\w\s,]*\bTINY\b""", src):
            offenders.append(f"{name}:{launches[0]}: starts ranks without naming gloo")
    assert not offenders, "\n".join(offenders)


def test_the_shared_tiny_flags_pick_gloo():
    assert launch.TINY[-2:] == ["--distributed-backend", "gloo"]
