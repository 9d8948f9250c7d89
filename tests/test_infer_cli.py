"""`commfuse generate`: a checkpoint of `commfuse train` generates the same text on 1 and 2
ranks, --bench prints every method, bad flags are refused before any rank starts.

The commands run in this process (`commfuse.cli.main`, their ranks forked as `commfuse` forks
them); what they and their ranks print is read from the file descriptors. The installed entry
point in a fresh interpreter is run by tests/test_train_cli.py."""

import json


def _refused(*args) -> tuple[int, str]:
    """`commfuse generate ARGS` in this process, for flags refused before any rank starts
    (exit status, stderr)."""
    import contextlib
    import io

    from commfuse import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = cli.main(["generate", *args])
        except SystemExit as e:
            rc = e.code
    return rc, err.getvalue()


def test_cli_generate_end_to_end(tmp_path, command):
    """Checkpoint of commfuse train (tp=2) -> generate with tp=1 and tp=2: the same text;
    --bench prints every method; bad flags are refused."""
    ck = tmp_path / "ck"
    train = command("train", "--tp", "2", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                    "--checkpoint-dir", str(ck), "--link", "loopback", "--hardware", "cpu-testbed")
    assert train.returncode == 0, train.stderr[-2000:]
    texts = []
    for tp in ("1", "2"):
        p = command("generate", "--prompt", "The history of", "--max-new-tokens", "6", "--tp", tp,
                    "--checkpoint", str(ck), "--link", "loopback", "--method", "commfuse",
                    "--hardware", "cpu-testbed")  # no fit: it only picks for auto
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.startswith("The history of")
        assert f"tp={tp}" in p.stderr and "tokens/s" in p.stderr
        texts.append(p.stdout)
    assert texts[0] == texts[1]
    p = command("generate", "--prompt-tokens", "5", "--max-new-tokens", "3", "--random-init",
                "--bench", "--iters", "1", "--tp", "2", "--link", "loopback", "--json",
                str(tmp_path / "b.json"))
    assert p.returncode == 0, p.stderr[-2000:]
    for m in ("none", "sliced", "decompose", "commfuse", "auto"):
        assert f"      5 {m}" in p.stdout
    out = json.loads((tmp_path / "b.json").read_text())
    assert "measured here" in out["hardware"] and out["gemm_flops"] > 0  # fitted at start
    assert "hardware model:" in p.stderr
    rows = out["rows"]
    assert [r["method"] for r in rows] == ["none", "sliced", "decompose", "commfuse", "auto",
                                           "interleaved", "allreduce", "compute alone"]
    assert all(r["prefill_ms"] > 0 and r["decode_tokens_per_s"] > 0 for r in rows)
    assert all(len(r["prefill_ms_rounds"]) == 1 for r in rows)  # --iters 1
    # auto's warm-up round: its first prefill, then each plan timed once (fused, interleaved)
    assert len(rows[4]["warmup_prefill_ms"]) == 3 and rows[4]["prefill_chunks"] in (1, 2)
    # the simulator predicts every row but the bound (no prediction for compute alone)
    assert [r["sim_prefill_ms"] != r["sim_prefill_ms"] for r in rows] == [False] * 7 + [True]
    # 5 tokens on 2 ranks: 2 chunks is the only count that gives every rank rows
    assert rows[5]["prefill_chunks"] == 2 and rows[3]["prefill_chunks"] == 1
    # auto decodes one sequence with allreduce's step, and its prediction is that step's
    auto, allreduce = rows[4], rows[6]
    assert (auto["decode_ran"], allreduce["decode_ran"]) == ("allreduce", "allreduce")
    assert auto["sim_decode_tokens_per_s"] == allreduce["sim_decode_tokens_per_s"]
    assert rows[3]["decode_ran"] == "commfuse"
    p = command("generate", "--prompt", "a", "--prompt", "bb b", "--tp", "2", "--random-init",
                "--max-new-tokens", "2", "--temperature", "0.7", "--top-k", "5", "--link",
                "loopback", "--hardware", "cpu-testbed")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("[0] a|") and "\n[1] bb b|" in p.stdout
    for flags, why in ((["--random-init", "--prefill-chunks", "0"],
                        "--prefill-chunks: must be at least 1"),
                       (["--random-init", "--top-p", "0"], "top_p"),
                       (["--random-init", "--hardware", "a-laptop"], "--hardware"),
                       ([], "--checkpoint")):
        rc, err = _refused("--prompt", "x", "--link", "loopback", *flags)
        assert rc == 2 and why in err, err
