"""Suite-wide switches: the NCCL-rules mode (:mod:`megazero.testing.nccl_rules`), and an
environment that no test leaks into the next.

The ZeRO, offload, NVMe, checkpoint and engine suites always run their multi-rank worlds under
the mode (once, not twice: the mode adds a log line per collective, not another run); every
other suite runs under it with ``pytest --nccl-rules`` or ``MEGAZERO_NCCL_RULES=1``;
``MEGAZERO_NCCL_RULES=0`` turns it off everywhere (to measure what it costs).
"""

from __future__ import annotations

import fnmatch
import os

import pytest

from megazero.testing import nccl_rules

# The suites whose worlds always run under the NCCL rules.
NCCL_RULES_SUITES = ("test_zero_*.py", "test_zero3_*.py", "test_checkpoint*.py",
                     "test_engine_*.py", "test_nccl_rules.py")


def pytest_addoption(parser):
    parser.addoption("--nccl-rules", action="store_true", default=False,
                     help="run every multi-rank test world under the NCCL-rules mode")


def pytest_configure(config):
    config.addinivalue_line("markers", "nccl_rules_off: run this test's worlds without the "
                                       "NCCL-rules mode even in a suite that forces it on")
    if config.getoption("--nccl-rules"):
        os.environ[nccl_rules.ENV] = "1"


# set before pytest starts: 0 turns the mode off everywhere, 1 on everywhere
_ASKED = os.environ.get(nccl_rules.ENV)


def under_nccl_rules(filename: str) -> bool:
    return any(fnmatch.fnmatch(filename, p) for p in NCCL_RULES_SUITES)


@pytest.fixture(autouse=True)
def _nccl_rules_for_suite(request, monkeypatch):
    if request.node.get_closest_marker("nccl_rules_off") is not None:
        monkeypatch.setenv(nccl_rules.ENV, "0")
    elif _ASKED is None and under_nccl_rules(os.path.basename(str(request.node.fspath))):
        monkeypatch.setenv(nccl_rules.ENV, "1")
    yield


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Every test leaves ``os.environ`` as it found it. Start-up code writes the launcher's
    variables (``RANK``, ``WORLD_SIZE``...) into the environment as torchrun would, and
    ``monkeypatch.delenv`` of a name that was absent records nothing to restore: a later
    test would inherit a 16-rank world."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
