"""The planner's MoE and Mamba-2 layers (commfuse.sim.step.arch, layers, work): bytes and
costs scale as the model says, memory shrinks with ep, both presets plan, bad layouts get a
clear error, and a hybrid made of Llama sub-layers predicts the Llama step. Pure: no
processes."""

import dataclasses
import json

import pytest

from commfuse.parallel.config import ParallelDims
from commfuse.sim import preset as hw_preset
from commfuse.sim.routing import expected_ranks
from commfuse.sim.step.arch import HybridConfig, MambaSpec, MoESpec, check_layout, sublayers
from commfuse.sim.step.arch import preset as arch_preset
from commfuse.sim.plan.hf_config import from_hf
from commfuse.sim.step.layers import hybrid_grad_sync_ops, layer_groups, moe_ops
from commfuse.sim.step.memory import step_memory
from commfuse.sim.step.ops import model_config, wire_bytes
from commfuse.sim.plan import plan, table
from commfuse.sim.plan.cli import main_plan
from commfuse.sim.step.timing import simulate_step
from commfuse.sim.step.train import simulate_train_step
from commfuse.sim.step import work
from commfuse.sim.step.work import TrainSetup

MOE = HybridConfig(vocab_size=1024, dim=256, n_layers=4, n_heads=4, ffn_hidden=512,
                   max_seq_len=1024, moe=MoESpec(experts=8, top_k=2, expert_ffn=384))


def _dispatch_bytes(cfg, ep, seq=512, mb=1, tp=1):
    f, _ = moe_ops(cfg, tp, 1, ep, ep, seq, mb)
    (op,) = [o for o in f if o.name.startswith("dispatch")]
    return wire_bytes(op, ep, 2)


def test_dispatch_bytes_are_uniform_routings_expectation():
    """Each rank sends one row of D elements (bf16) per token and remote destination rank:
    tokens x expected_ranks x (W-1)/W (the dedup; tests/test_moe_dedup_cost.py checks the
    expectation against the routing code)."""
    for ep in (2, 4, 8):
        assert _dispatch_bytes(MOE, ep) == pytest.approx(
            512 * expected_ranks(8, ep, 2) * (ep - 1) / ep * 256 * 2)
    top4 = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, top_k=4))
    assert _dispatch_bytes(top4, 4) == pytest.approx(
        expected_ranks(8, 4, 4) / expected_ranks(8, 4, 2) * _dispatch_bytes(MOE, 4))
    f, _ = moe_ops(MOE, 1, 1, 1, 1, 512, 1)  # ep=1: the same GEMMs, nothing on the wire
    assert all(wire_bytes(o, 1, 2) == 0 for o in f)
    assert _dispatch_bytes(MOE, 4, tp=2) == pytest.approx(_dispatch_bytes(MOE, 4) / 2)


def test_expert_flops_are_top_k_rows_whatever_ep():
    def flops(ep):
        f, b = moe_ops(MOE, 1, 1, ep, ep, 512, 1)
        return sum(2 * o.shape[0] / (ep if o.axis == "ep" else 1) * o.shape[1] * o.shape[2]
                   for o in f + b if o.kind != "all_gather")
    assert flops(1) == pytest.approx(flops(8))
    rows = 512 * 2
    assert flops(1) == pytest.approx(2 * 512 * 256 * 8 * 3  # router fwd, dx, dW
                                     + 3 * 2 * rows * 256 * 384 * 3)  # 3 experts' matmuls x 3


def test_scan_cost_grows_with_tokens_and_state():
    hw, cfg = hw_preset("h100-nvlink"), arch_preset("nemotron-h-8b")
    t = work.scan_time(hw, cfg, 4096, 4096, 1)
    assert work.scan_time(hw, cfg, 4096, 8192, 1) == pytest.approx(2 * t)
    assert work.scan_time(hw, cfg, 4096, 4096, 2) == pytest.approx(t / 2)  # heads / tp
    big = dataclasses.replace(cfg, mamba=dataclasses.replace(cfg.mamba, d_state=256))
    assert work.scan_time(hw, big, 4096, 4096, 1) > 1.5 * t
    assert work.scan_time(hw, cfg, 4096, 4096, 1, backward=True) == pytest.approx(2 * t)


def test_memory_shrinks_with_ep():
    """The routed experts are sharded over all dp ranks (ep x the edp ZeRO shards), so the
    kept parameters do not depend on ep; what FSDP gathers per layer (E/ep experts) does."""
    cfg = model_config("mixtral-8x7b")
    mems = [step_memory(cfg, 1, 1, 8, 4096, 1, ep=ep) for ep in (1, 2, 8)]
    assert mems[0].parts["params"] == pytest.approx(mems[2].parts["params"])
    gathered = [m.parts["gathered weights"] for m in mems]
    assert gathered[0] > gathered[1] > gathered[2]
    assert mems[0].peak_gib > mems[1].peak_gib > mems[2].peak_gib
    expert = 3 * 4096 * 14336 * 2  # one routed expert's weights in bf16
    assert gathered[0] - gathered[2] == pytest.approx(2 * (8 - 1) * expert)  # two layers
    one = step_memory(cfg, 1, 1, 1, 4096, 1).parts["params"]
    assert mems[2].parts["params"] < one / 7  # 8 ranks hold an eighth, norms aside


def test_presets_follow_their_sources():
    n = arch_preset("nemotron-h-8b")
    s = sublayers(n)
    assert (len(s), s.count("M"), s.count("*"), s.count("-")) == (52, 24, 4, 24)
    assert n.mamba.d_inner == 2 * n.dim and n.dim == 4096
    d = arch_preset("deepseek-v2-lite")
    assert sublayers(d).startswith("*-*E") and sublayers(d).count("E") == 26
    assert sublayers(arch_preset("mixtral-8x7b")) == "*E" * 32


def test_both_presets_plan_with_ep_and_tp(tmp_path, capsys):
    plans, _ = plan("mixtral-8x7b", 8, "h100-nvlink", seq=4096, local_batch=1,
                    methods=("none", "commfuse"), setup=TrainSetup())
    assert {p.ep for p in plans} == {1, 2, 4, 8}
    assert not any(p.fits for p in plans)  # 46.7B x 16 B (weights, grads, AdamW) / 8 > 80 GiB
    assert all(p.peak_memory_gib > 0 and p.tokens_per_s_per_device > 0 for p in plans)
    plans, rejected = plan("nemotron-h-8b", 8, "h100-nvlink", seq=8192, local_batch=2,
                           micro_batch=1, methods=("none", "commfuse"), setup=TrainSetup())
    assert {p.tp for p in plans} == {1, 2, 4, 8} and all(p.up == 1 for p in plans)
    assert any("Ulysses is not modelled for Mamba" in r[-1] for r in rejected)
    out = tmp_path / "p.json"
    assert main_plan(["--model", "mixtral-8x7b", "--devices", "8", "--seq", "4096",
                      "--layout", "1,1,8,8", "--methods", "none,auto", "--no-files",
                      "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "32 MoE layers of 8 experts top-2" in text and "ep=8" in text
    assert {r["ep"] for r in json.loads(out.read_text())} == {8}


@pytest.mark.parametrize("change, layout, message", [
    (None, (1, 1, 6, 3), "experts (8) must be divisible by ep=3"),
    (None, (1, 1, 4, 8), "ep=8 must divide dp=4"),
    ("mamba", (2, 1, 1, 1), "ep=1"),  # valid: no error
    ("mamba", (1, 2, 1, 1), "Ulysses is not modelled for Mamba"),
    ("mamba3", (2, 1, 1, 1), "Mamba heads (3) must be divisible by tp=2"),
    ("dense", (1, 1, 2, 2), "ep=2: the model has no MoE layers"),
])
def test_bad_layouts_name_what_does_not_divide(change, layout, message):
    cfg = MOE
    if change == "mamba":
        cfg = HybridConfig(dim=128, n_heads=4, pattern="M*M-", mamba=MambaSpec(4, 32, 16, 2))
    elif change == "mamba3":
        cfg = HybridConfig(dim=128, n_heads=4, pattern="M*", mamba=MambaSpec(3, 32, 16, 1))
    elif change == "dense":
        cfg = HybridConfig(dim=128, n_heads=4, pattern="*-")
    if message == "ep=1":
        check_layout(cfg, *layout)
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_layout(cfg, *layout)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="MoE layers .E. but moe is None"):
        HybridConfig(pattern="*E")
    with pytest.raises(ValueError, match="unknown layer kinds"):
        HybridConfig(pattern="*X")
    with pytest.raises(ValueError, match="top_k"):
        MoESpec(experts=4, top_k=8, expert_ffn=16)
    with pytest.raises(ValueError, match="divisible by n_groups"):
        MambaSpec(heads=6, head_dim=8, d_state=4, n_groups=4)
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        simulate_step(MOE, ParallelDims(dp=4, method="none", world_size=4), "h100-nvlink",
                      seq=512, ep=3)


@pytest.mark.parametrize("tp, dp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_a_hybrid_of_llama_sublayers_predicts_the_llama_step(tp, dp):
    """Attention and MLP sub-layers are the two halves of the Llama block: the same ops,
    the same step, the same whole step without FSDP."""
    llama = model_config("tiny")
    hybrid = HybridConfig(**{f.name: getattr(llama, f.name) for f in
                             dataclasses.fields(llama)}, pattern="*-" * llama.n_layers)
    (block,) = layer_groups(llama, tp, 1, dp, 256, 1)
    split = layer_groups(hybrid, tp, 1, dp, 256, 1)
    assert sorted(map(repr, block.fwd)) == sorted(repr(o) for g in split for o in g.fwd)
    dims = ParallelDims(tp=tp, dp=dp, method="commfuse", world_size=tp * dp)
    kw = dict(seq=256, batch=2 * dp, micro_batch=1)
    a, b = (simulate_step(c, dims, "h100-nvlink", **kw) for c in (llama, hybrid))
    assert b.step_s == pytest.approx(a.step_s) and b.mfu == pytest.approx(a.mfu)
    setup = TrainSetup(fsdp=False)
    a, b = (simulate_train_step(c, dims, "h100-nvlink", setup=setup, **kw)
            for c in (llama, hybrid))
    assert b.step_s == pytest.approx(a.step_s)
    assert b.peak_memory_gib == pytest.approx(a.peak_memory_gib, rel=0.02)


def test_experts_over_the_tp_group():
    """ep_axis="tp" (what commfuse train --ep runs): the all-to-alls on the TP group, the
    experts split there (no TP all-reduce of their gradients), ZeRO-sharded over all dp."""
    f, b = moe_ops(MOE, 2, 1, 4, 2, 512, 1, ep_axis="tp")
    a2a = [o for o in f + b if o.kind in ("a2a_matmul", "matmul_a2a")]
    assert len(a2a) == 4 and {o.axis for o in a2a} == {"tp"}
    assert {o.axis for o in f + b if "experts" in o.name and "RS" in o.name} == {"dp"}
    replicated = hybrid_grad_sync_ops(MOE, 2, 1, 1, 1)
    split = hybrid_grad_sync_ops(MOE, 2, 1, 1, 2, ep_axis="tp")
    expert = 3 * 256 * 384 * 8 * 4 * 2  # every routed expert of the 4 layers, bf16 grads
    assert replicated[0].shape[0] - split[0].shape[0] == pytest.approx(expert)
    with pytest.raises(ValueError, match="needs ep = tp"):
        check_layout(MOE, 2, 1, 2, 1, "tp")
    plans, _ = plan(MOE, 4, "h100-nvlink", seq=512, methods=("none",))
    assert {(p.tp, p.ep, p.ep_axis) for p in plans if p.ep_axis == "tp"} == {(2, 2, "tp"),
                                                                            (4, 4, "tp")}
    assert "2tp" in table(plans)


def test_hf_configs_plan_as_commfuse_train_builds_them(capsys):
    """The shipped --hf-config names read as the planner's configs (JSON, no transformers)."""
    mixtral, qwen = from_hf("mixtral-tiny"), from_hf("qwen3-moe-tiny")
    assert sublayers(mixtral) == "*E*E" and mixtral.moe == MoESpec(8, 2, 256)
    assert qwen.moe.expert_ffn == 128 and qwen.head_dim == 32
    assert sublayers(from_hf("bamba-tiny")) == "M-*-" and sublayers(from_hf("mamba2-tiny")) == "MM"
    assert type(from_hf("llama-tiny")).__name__ == "LlamaConfig"
    nemo = from_hf("nemotron-h-tiny")  # a 344-wide squared-ReLU MLP: SwiGLU 2/3 x 344, up to 8
    assert sublayers(nemo) == "M-*-" and nemo.ffn_hidden == 232 and nemo.mamba.heads == 8
    with pytest.raises(ValueError, match="no config"):
        from_hf("no-such-model")
    assert main_plan(["--hf-config", "mixtral-tiny", "--devices", "2", "--hw", "cpu-testbed",
                      "--inter-hw", "same", "--seq", "256", "--layout", "2,1,1,tp",
                      "--methods", "none,commfuse", "--no-files"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mixtral-tiny") and "ep=2tp" in out
