"""pytest marks shared by several test files."""

import os
import shutil

import pytest

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
    reason="network emulation needs root and iproute2")
"""Skip unless this machine can build the emulated cluster (root and iproute2)."""
