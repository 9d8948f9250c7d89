"""``commfuse train``: the command (`run`), which launches the ranks' loops
(`commfuse.train.loop`), with ``--compare-none`` method none beside them
(`commfuse.train.compare`), and moves them onto the emulated cluster (``--link``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from commfuse.train.compare import link_label, paired_rank, record, sequential_none, verdict
from commfuse.train.config import TrainConfig, config_from_args
from commfuse.train.loop import launch


def run(args) -> int:
    """``commfuse train``: train; with --compare-none, method none beside it on the same
    steps (`commfuse.train.compare`), then the verdict.

    A failed rank (a dead or stalled peer, any exception) ends the run with exit code 1 and
    a message naming the last complete checkpoint to ``--resume`` from."""
    from commfuse.errors import CommFuseError
    from commfuse.testbed.spawn import RankFailed

    cfg = config_from_args(args)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if "RANK" in os.environ else cfg.world
    if (err := cfg.device_error(local)) is not None:
        print(f"commfuse train: {err}", file=sys.stderr)
        return 2
    relaunched = on_emulated_cluster(args, cfg)
    if relaunched is not None:
        return relaunched
    compare = getattr(args, "compare_none", False) and cfg.method != "none"
    paired = compare and not cfg.hf_config  # --hf-config: the two runs one after the other
    try:
        if paired:
            first, base = launch(cfg, paired_rank)
        else:
            first = launch(cfg)
            base = launch(sequential_none(cfg)) if compare else None
    except (RankFailed, CommFuseError, TimeoutError) as e:
        print(f"commfuse train: failed: {e}", file=sys.stderr)
        latest = Path(cfg.checkpoint_dir or "", "latest")
        print(f"commfuse train: last complete checkpoint: "
              f"{latest.parent / latest.read_text().strip() if latest.is_file() else 'none'}"
              f"{' (continue with --resume)' if latest.is_file() else ''}", file=sys.stderr)
        return 1
    if compare and first and base and int(os.environ.get("RANK", 0)) == 0:
        v = verdict(cfg, first, base, link_label(cfg.world, cfg.device), paired)
        how = "median of the steps' ratios" if paired else "ratio"
        print(f"compare-none: max |loss - loss(none)| = {v.max_loss_diff:.3g}; median step "
              f"{cfg.method} {v.step_s * 1e3:.1f} ms / none {v.none_step_s * 1e3:.1f} ms; "
              f"{how} {v.ratio:.3f}")
        print(v.line(), flush=True)
        if cfg.metrics_json:
            record(cfg.metrics_json, v)
    return 0


def on_emulated_cluster(args, cfg: TrainConfig) -> int | None:
    """``--link``: run this same command as ``cfg.world`` ranks on the emulated cluster
    (`commfuse.testbed.launch`) and return its exit code; None when it runs here instead
    (under torchrun, one rank, ``--link loopback``, or ``auto`` without root / iproute2)."""
    link = getattr(args, "link", "loopback")
    if link == "loopback" or cfg.world == 1 or "RANK" in os.environ or cfg.device != "cpu":
        return None
    from commfuse.testbed.launch import ClusterSpec, launch as launch_ranks
    from commfuse.testbed.links import LinkSpec
    from commfuse.testbed.net import EmulationUnavailable, check_available

    try:
        check_available()
    except EmulationUnavailable as e:
        if link != "auto":
            raise SystemExit(f"commfuse train: --link {link}: {e}")
        print("commfuse train: local ranks on loopback (network emulation needs root and "
              "iproute2): they share the cores and transfers cost no time, so step times "
              "show no overlap", file=sys.stderr)
        return None
    rate = "1gbit" if link == "auto" else link
    spec = ClusterSpec(nproc=cfg.world, link=LinkSpec(rate=rate, delay="0us"))
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    rest = argv[argv.index("train") + 1:] if "train" in argv else argv
    print(f"commfuse train: {cfg.world} ranks on the emulated cluster ({rate} links, one core "
          f"each; --link loopback to run them on loopback)", file=sys.stderr)
    return launch_ranks(spec, [sys.executable, "-m", "commfuse.cli", "train", *rest])
