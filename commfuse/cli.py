"""``commfuse``: the command line. Each subcommand's ``--help`` is its manual."""

from __future__ import annotations

import argparse
import importlib
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


def _bench_parser(sub) -> None:
    from commfuse.bench import cli as bench_cli, training

    p = sub.add_parser(
        "bench", help="measure every method side by side on an emulated cluster",
        description="Benchmark the fused ops, the paper's layers (op, layer) or whole training "
                    "runs (train) with every method. See commfuse bench KIND --help.")
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    for kind, what in bench_cli.KINDS.items():
        q = kinds.add_parser(
            kind, help=what, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
            description=f"Benchmark {what} with every method in the same run, interleaved, "
                        "after warm-up. Per method: median and spread of the step, compute "
                        "alone, exposed communication, hidden fraction, fraction of the testbed "
                        "limit, ratio to none. Ranks run in network namespaces with shaped links "
                        "(root needed; otherwise loopback). Writes a table, JSON, a PNG chart "
                        "and a Chrome/Perfetto trace (open in ui.perfetto.dev).")
        bench_cli.add_arguments(q, kind)
    q = kinds.add_parser("train", help="commfuse train per preset x layout x method: the "
                         "training table (bench-out/train/<date>-training.md)",
                         description=training.DESCRIPTION, epilog=training.EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    training.add_arguments(q)


def _train_parser(sub) -> None:
    from commfuse import train

    p = sub.add_parser("train", help="train a Llama preset, or a transformers config "
                       "(--hf-config), on the shipped corpus with TP/UP/DP (EP: MoE configs)",
                       description=train.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_arguments(p)
    p.set_defaults(run=train.run)


def _generate_parser(sub) -> None:
    from commfuse.infer import cli as infer_cli

    p = sub.add_parser("generate", help="generate text with the Llama, tensor-parallel (KV cache, "
                       "fused ops in prefill and decode)", description=infer_cli.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    infer_cli.add_arguments(p)
    p.set_defaults(run=infer_cli.run)


def _forwarding_parser(sub, name: str, help: str, module: str, main: str) -> None:
    """A subcommand whose arguments all go to ``module.main(argv)``, imported when run (its
    own parser, so ``commfuse NAME --help`` is that module's manual)."""
    p = sub.add_parser(name, add_help=False, prefix_chars="\0", help=help,
                       description=f"See commfuse {name} --help.")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(run=lambda a: getattr(importlib.import_module(module), main)(a.args))


def _simulate_parser(sub) -> None:
    _forwarding_parser(sub, "simulate", "predict every method's time on a hardware model "
                       "(commfuse.sim)", "commfuse.sim.cli", "main_simulate")


def _plan_parser(sub) -> None:
    _forwarding_parser(sub, "plan", "rank every TP/UP/DP layout and method of a model by "
                       "predicted step time (commfuse.sim)", "commfuse.sim.plan.cli", "main_plan")


def _check_gpu_parser(sub) -> None:
    _forwarding_parser(sub, "check-gpu", "check the CUDA path on this machine's GPUs, pass/fail "
                       "per check (exit 2 without a CUDA device)", "commfuse.check_gpu", "main")


def _launch_parser(sub) -> None:
    from commfuse.testbed import launch

    p = sub.add_parser(
        "launch", help="run a command on N ranks of an emulated cluster",
        description="Run a command on N ranks, each in its own network namespace with shaped "
                    "links (tc tbf + netem), gloo bound to the rank's interface; torchrun-style "
                    "env (RANK, WORLD_SIZE, MASTER_ADDR, ...). Everything is torn down on exit, "
                    "Ctrl-C or crash. Example: commfuse launch --nproc 2 --link 1gbit -- "
                    "python -m mymodule")
    launch.add_launch_arguments(p)
    p.set_defaults(run=launch.main_launch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commfuse",
        description="commfuse: collectives fused with GEMMs as overlapped peer-to-peer "
                    "schedules (CommFuse, arXiv 2604.24013) on any torch.distributed backend.")
    import commfuse

    parser.add_argument("--version", action="version", version=f"commfuse {commfuse.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _train_parser(sub)
    _generate_parser(sub)
    _demo_parser(sub)
    _bench_parser(sub)
    _simulate_parser(sub)
    _plan_parser(sub)
    _launch_parser(sub)
    _check_gpu_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # train/generate re-run as ranks
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
