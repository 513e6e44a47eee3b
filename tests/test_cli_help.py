"""``--help`` of the entry point and every tool: it runs, lists each flag with its default, its
choices and a line of meaning, under Megatron's headings. Flags typed explicitly are known as
such (``--log-interval=5`` beats the JSON's ``steps_per_print``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from megazero.config import FLAGS, build_parser, load_config
from megazero.config.flag_help import GROUPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = sorted(f for f in os.listdir(os.path.join(ROOT, "tools")) if f.endswith(".py"))


def _run_help(script: str, flag: str) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, os.path.join(ROOT, script), flag], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return out.stdout


def _entries(text: str) -> dict[str, str]:
    """option string -> its help text (argparse's two-column layout, wrapped lines joined)."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (-[-\w]+)(.*)$", line)
        if m:
            current = m.group(1)
            entries[current] = m.group(2)
        elif current and line.startswith("      "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_pretrain_help_lists_every_flag_with_default_choices_and_meaning(flag):
    text = _run_help("pretrain_gpt.py", flag)
    entries = _entries(text)
    for f in FLAGS:
        body = entries[f.names[0]]
        assert "default" in body, (f.names[0], body)
        # a line of meaning besides the default
        assert len(re.sub(r"default:? \S+", "", body.split("  ", 1)[-1]).strip()) > 8, body
        if "choices" in f.kwargs:
            assert "{" + ",".join(map(str, f.kwargs["choices"])) + "}" in body
    for heading in ("model:", "parallelism:", "training:", "learning rate:", "data:",
                    "checkpointing:", "logging:", "mixed precision:", "distributed:"):
        assert f"\n{heading}\n" in text
    assert "--log-json" in entries and "--tokenizer-type" in entries
    assert "GPT2BPETokenizer" in entries["--tokenizer-type"]
    assert "default: 0.0003" in entries["--lr"]
    assert "MEGAZERO_DEBUG" in text


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_help_shows_defaults(tool):
    text = _run_help(os.path.join("tools", tool), "--help")
    entries = _entries(text)
    assert entries
    parser_defaults = [e for e in entries.values() if "(default:" in e]
    assert parser_defaults, text
    for name, body in entries.items():
        if name not in ("-h", "--help"):
            assert body.strip(), f"{tool} {name} has no help text"


def test_parser_groups_are_megatrons_headings():
    titles = [g.title for g in build_parser()._action_groups if g._group_actions]
    assert set(titles) - {"options", "optional arguments"} <= set(GROUPS)


def test_log_json_is_a_flag_and_explicit_log_interval_wins(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"steps_per_print": 7}))
    base = ["--deepspeed_config", str(ds)]
    assert load_config(base, 1).logging.log_interval == 7
    assert load_config(base + ["--log-interval=5"], 1).logging.log_interval == 5
    assert load_config(base + ["--log-interval", "5"], 1).logging.log_interval == 5
    assert load_config(["--log-json=m.jsonl"], 1).logging.log_json == "m.jsonl"


def test_readme_says_how_to_make_the_tokenizer_and_what_must_be_shared():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    own = text[text.index("Your own corpus"):text.index("- **Parallelism**")]
    assert "tools/train_tokenizer.py" in own and "--output-prefix tok" in own
    multi = text[text.index("## Multi-node"):text.index("## SLURM")]
    for flag in ("--save", "--load", "--data-cache-path"):
        assert f"`{flag}`" in multi
    assert "every node sees" in multi
    assert "MEGAZERO_DEBUG=1" in text
