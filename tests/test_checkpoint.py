"""`save_checkpoint` replaces ``latest`` atomically: re-saving the step ``latest`` names, and a
crash at any point of it, leave a ``latest`` that loads (one process, no process group)."""

import os
import shutil

import torch

from commfuse.models.llama import Llama, LlamaConfig
from commfuse.parallel import checkpoint
from commfuse.parallel.plan import parallelize

META = {"layout": "single"}


def _model(seed: int):
    torch.manual_seed(seed)
    cfg = LlamaConfig.preset("tiny", dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                             ffn_hidden=32, max_seq_len=8, vocab_size=64)
    pmodel = parallelize(Llama(cfg), None)
    return pmodel, torch.optim.AdamW(pmodel.parameters(), lr=1e-3)


def _params(pmodel) -> list[torch.Tensor]:
    return [p.detach().clone() for p in pmodel.parameters()]


def _latest_is_valid(root) -> bool:
    """``latest`` names a complete checkpoint directory (DCP metadata and meta.json)."""
    pointer = os.path.join(root, "latest")
    if not os.path.isfile(pointer):
        return False
    path = os.path.join(root, open(pointer).read().strip())
    return os.path.isfile(os.path.join(path, ".metadata")) and \
        os.path.isfile(os.path.join(path, "meta.json"))


class Crash(Exception):
    pass


def _watch(monkeypatch, root, crash_at: int | None, seen: list):
    """Wrap every rename/replace/rmtree under ``root``: before each, ``latest`` must be valid
    (recorded in ``seen``); the ``crash_at``-th one raises `Crash` instead of running."""
    calls = [0]

    def wrap(real):
        def fn(*args, **kw):
            if str(args[0]).startswith(str(root)):
                calls[0] += 1
                seen.append(_latest_is_valid(root))
                if calls[0] == crash_at:
                    raise Crash(f"crash before {real.__name__}{args}")
            return real(*args, **kw)
        return fn

    monkeypatch.setattr(os, "rename", wrap(os.rename))
    monkeypatch.setattr(os, "replace", wrap(os.replace))
    monkeypatch.setattr(shutil, "rmtree", wrap(shutil.rmtree))
    return calls


def test_resaving_the_latest_step_keeps_a_valid_latest_at_every_point(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    first, opt = _model(0)
    checkpoint.save_checkpoint(first, opt, str(root), 2, META)
    before = _params(first)
    second, opt2 = _model(1)  # other values, saved again as step 2
    after = _params(second)
    assert not all(torch.equal(a, b) for a, b in zip(before, after))
    crash_at = 1
    while True:
        seen: list = []
        with monkeypatch.context() as m:
            calls = _watch(m, root, crash_at, seen)
            try:
                checkpoint.save_checkpoint(second, opt2, str(root), 2, META)
                done = True
            except BaseException as e:  # DCP wraps a crash in its save: CheckpointException
                assert "crash before" in str(e), e
                done = False
        assert seen and all(seen), (crash_at, seen)  # valid before every rename/delete
        probe, popt = _model(2)
        assert checkpoint.load_checkpoint(probe, popt, str(root), META) == 2, crash_at
        got = _params(probe)
        old = all(torch.equal(a, b) for a, b in zip(got, before))
        new = all(torch.equal(a, b) for a, b in zip(got, after))
        assert old or new, f"crash at {crash_at}: latest loads neither the old nor the new state"
        if done:
            break
        crash_at += 1
    assert new and calls[0] >= 3  # the new state won, after a rename, a replace and a delete
    assert [n for n in os.listdir(root) if n.startswith("step-")] == [
        open(root / "latest").read().strip()]  # the old versions are gone
    # once more: a third version replaces the second
    checkpoint.save_checkpoint(first, opt, str(root), 2, META)
    probe, popt = _model(3)
    assert checkpoint.load_checkpoint(probe, popt, str(root), META) == 2
    assert all(torch.equal(a, b) for a, b in zip(_params(probe), before))
    assert len([n for n in os.listdir(root) if n.startswith("step-")]) == 1
