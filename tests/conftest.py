import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # dist_cases, importable by spawned ranks too

from dataclasses import dataclass

import pytest

# What the ranks of tests import beyond `spawn.PRELOAD`: the fork server imports them once.
# transformers with its Llama (~2 s; the other architectures share most of it) is imported by
# the ranks of test_tp*, test_infer_hf and test_generate_arch: once here, not per rank (an
# ImportError, where it is not installed, leaves it out).
PRELOAD = ("commfuse.models.llama", "commfuse.parallel", "commfuse.train.loop", "commfuse.infer",
           "commfuse.tp", "pytest", "hypothesis", "dist_cases", "transformers",
           "transformers.models.llama.modeling_llama")


def pytest_addoption(parser):
    parser.addoption("--spawn-ranks", action="store_true",
                     help="start every rank as a fresh interpreter (each imports torch) "
                          "instead of forking it from a server that imported it once")


# The files that take longest, longest first (their tests' --durations summed, 2 cores).
# pytest-xdist (`--dist loadfile --no-loadscope-reorder` in pyproject) hands whole files to its
# two workers in collection order, a next file to whichever finishes first: started first,
# the long files run beside the many short ones instead of leaving one worker alone with a
# long file at the end. A file not listed keeps its place after them.
LONGEST_FIRST = ("test_moe_hf.py", "test_tp_families.py", "test_tp_generate.py", "test_ops_dist.py", "test_parallel.py", "test_tp_mamba.py",
                 "test_doc_commands.py", "test_llama.py", "test_probe.py", "test_cluster.py",
                 "test_faults.py", "test_examples.py", "test_compile.py", "test_bench_train.py",
                 "test_memory.py", "test_train_cli.py", "test_infer.py", "test_tp.py",
                 "test_regather_prefetch.py", "test_moe_balance.py", "test_bench.py", "test_tp_compile.py",
                 "test_train.py", "test_infer_hf.py", "test_train_hf.py", "test_infer_cli.py",
                 "test_train_moe.py", "test_train_mamba.py", "test_generate_arch.py",
                 "test_query_split.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in order


def pytest_configure(config):
    from commfuse.testbed import spawn

    spawn.start_ranks("spawn" if config.getoption("--spawn-ranks") else "forkserver", PRELOAD)


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


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def command(capfd):
    """``command("generate", ...)``: run a ``commfuse`` subcommand in this process, as the
    installed command would (its ranks forked as it forks them); its exit status and what it
    and its ranks printed, read from the file descriptors."""
    from commfuse import cli as entry

    def run(*args) -> Ran:
        capfd.readouterr()
        try:
            rc = entry.main(list(args))
        except SystemExit as e:
            rc = e.code
        out, err = capfd.readouterr()
        return Ran(rc, out, err)

    return run
