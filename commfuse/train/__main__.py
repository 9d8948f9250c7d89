"""``python -m commfuse.train`` (e.g. under ``torchrun``): the same flags as ``commfuse train``."""

from __future__ import annotations

import argparse
import sys

import torch.distributed as dist

import commfuse.train
from commfuse.train.config import add_arguments
from commfuse.train.command import run


def main(argv: list[str] | None = None) -> int:
    """``python -m commfuse.train`` (e.g. under ``torchrun``), the same flags as the CLI."""
    parser = argparse.ArgumentParser(prog="commfuse train", description=commfuse.train.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    rc = run(parser.parse_args(argv))
    if rc == 0 and dist.is_initialized():  # after a failure, tearing down could wait on the dead
        dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
