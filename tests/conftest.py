import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # dist_cases, importable by spawned ranks too

import pytest


@pytest.fixture(autouse=True)
def default_hardware():
    """Each test starts from the default hardware model of auto's choices, and leaves it as
    it found it: a `set_hardware` or `calibrate` in this process (an in-process
    `commfuse train` or `generate` fits the model to the machine) must not change later
    tests' choices."""
    from commfuse.ops import auto

    saved = dict(auto._HARDWARE)
    auto.set_hardware("cpu-testbed")  # clears every cached choice too
    auto._HARDWARE.clear()
    yield
    auto.set_hardware("cpu-testbed")
    auto._HARDWARE.clear()
    auto._HARDWARE.update(saved)
