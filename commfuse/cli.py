"""``commfuse``: the command line. Each subcommand's ``--help`` is its manual."""

from __future__ import annotations

import argparse
import sys


def _demo_parser(sub) -> None:
    p = sub.add_parser(
        "demo", help="run every op with every method on local ranks, check, time",
        description="Spawn local ranks (gloo), run the four fused ops with every method "
                    "(none, sliced, decompose, commfuse ring/direct), check outputs and "
                    "gradients against method=none, and print a table of times per method.")
    p.add_argument("--nproc", type=int, default=4, help="local ranks to spawn (default 4)")
    p.add_argument("--seq", type=int, default=512,
                   help="sequence length; divisible by --nproc (default 512)")
    p.add_argument("--d-model", type=int, default=256,
                   help="model width; 4*d_model and d_model divisible by --nproc (default 256)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per method (default 5)")
    p.add_argument("--timeout", type=float, default=600, help="give up after this many seconds")
    p.set_defaults(run=_run_demo)


def _run_demo(args) -> int:
    if args.nproc < 1 or args.seq % args.nproc or args.d_model % args.nproc:
        sys.exit(f"commfuse demo: --seq ({args.seq}) and --d-model ({args.d_model}) must be "
                 f"divisible by --nproc ({args.nproc})")
    from commfuse import demo

    return demo.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commfuse",
        description="commfuse: collectives fused with GEMMs as overlapped peer-to-peer "
                    "schedules (CommFuse, arXiv 2604.24013) on any torch.distributed backend.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _demo_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
