"""`derive_plan`: the `Plan` of a transformers causal LM, derived from its config's
``base_model_tp_plan`` and its module types (`commfuse.tp.plan`'s docstring lists what each
module becomes). `_Deriver` walks the model once, collecting every problem; a mechanism that
plans a module as a whole (a sparse MoE block, a Mamba-2 or Gated DeltaNet mixer, a latent
attention) is an entry of ``WHOLE``."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from commfuse.tp.attention import (KV, attention_problems, halves_rows, head_counts,
                                   head_problems, kv_replicas, packed_qkv_rows)
from commfuse.tp.embedding import Partial, VocabParallelEmbedding
from commfuse.tp.experts import ExpertParallel, expert_spec, is_sparse
from commfuse.tp.loss import head_style
from commfuse.tp.mixers.deltanet import DeltaNetParallel, deltanet_layout, is_gated_deltanet
from commfuse.tp.mixers.mamba import MambaMixerParallel, is_mamba2, mixer_layout
from commfuse.tp.mixers.mla import is_mla, mla_plan
from commfuse.tp.norms import SplitDimNorm, rms_norm_like
from commfuse.tp.style import PlanStyles, plan_styles
from commfuse.tp.sequence import ReplicateParallel, ShardSequence
from commfuse.tp.style import FusedColwiseParallel, FusedProjections


# base_model_tp_plan's styles -> the role commfuse gives the module
STYLES = {"colwise": "col", "colwise_gather_output": "col", "packed_colwise": "col",
          "rowwise": "row", "rowwise_split_input": "row", "packed_rowwise": "row",
          "replicated_with_grad_allreduce": "norm"}
# a linear the config's plan does not name, by its own name
BY_NAME = {**dict.fromkeys(("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj",
                            "gate_up_proj", "fc1", "c_fc", "input_linear"), "col"),
           **dict.fromkeys(("o_proj", "down_proj", "dense", "fc2", "c_proj", "output_linear"),
                           "row")}
# packed colwise projections (Granite's shared MLP: input_linear's first half the gate)
PACKED = {"qkv_proj": "q|k|v", "gate_up_proj": "gate|up", "input_linear": "gate|up"}
ATTENTION = ("q_proj", "k_proj", "v_proj", "qkv_proj")  # a parent with these is an attention
ROUTER_EXTRAS = ("router_jitter_noise",)  # MoE config fields with no plan here when set
# a sparse block's linears that run on each routed token whole (Nemotron-H's latent
# projections around the experts): replicated, their gradients summed
PER_TOKEN = ("fc1_latent_proj", "fc2_latent_proj")
# modules planned as a whole: (test, the _Deriver method that plans it and returns the
# children it covered: None for all of them)
WHOLE = ((is_sparse, "_sparse"), (is_gated_deltanet, "_deltanet"), (is_mla, "_mla"),
         (is_mamba2, "_mamba"))


@dataclass
class Plan:
    """A model's derived plan: module name -> style, the attention modules whose head
    counts become this rank's, whether the embedding is tied to the head, and the attention
    modules whose own parameters are per head (sinks: `HeadParameters`)."""

    styles: dict = field(default_factory=dict)
    attention: list = field(default_factory=list)
    tied: bool = False
    head_params: list = field(default_factory=list)  # attentions with per-head parameters


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or (
        "Norm" in type(module).__name__
        and isinstance(getattr(module, "weight", None), nn.Parameter))


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def _config_roles(cfg) -> dict[str, str]:
    """``base_model_tp_plan`` as layer-relative name -> role (entries outside the layers,
    or with a style commfuse does not know, are left to the module types)."""
    roles = {}
    for pattern, style in (getattr(cfg, "base_model_tp_plan", None) or {}).items():
        if pattern.startswith("layers.*.") and style in STYLES:
            roles[pattern.removeprefix("layers.*.")] = STYLES[style]
    return roles


def base_model(model: nn.Module) -> tuple[str, nn.Module]:
    """``(name, module)`` of a causal LM's decoder: its ``base_model``, or its ``model`` where
    the prefix names another (Llama 4's text model says ``language_model``)."""
    base = model.base_model
    if base is model and isinstance(getattr(model, "model", None), nn.Module):
        return "model", model.model
    return model.base_model_prefix, base


class _Deriver:
    """Walks one model and builds its `Plan`, collecting every problem on the way."""

    def __init__(self, model: nn.Module, T: int, ps: PlanStyles, loss_parallel: bool, moe):
        self.model, self.T, self.ps, self.moe = model, T, ps, moe
        self.cfg = model.config
        self.loss_parallel = loss_parallel
        self.problems: list[str] = []
        self.plan = Plan()
        self.roles = _config_roles(self.cfg)
        H, _ = head_counts(self.cfg) if hasattr(self.cfg, "num_attention_heads") else (0, 0)
        self.head_dim = getattr(self.cfg, "head_dim", None) or (
            self.cfg.hidden_size // H if H else None)

    def derive(self) -> Plan:
        model = self.model
        prefix, base = base_model(model)
        layers = getattr(base, "layers", None)
        if base is model or not isinstance(layers, nn.ModuleList) or not len(layers):
            raise ValueError(f"commfuse.tp.parallelize does not know {type(model).__name__}: "
                             f"it takes a causal LM whose base model ({prefix!r}) has a "
                             f"non-empty ModuleList 'layers'")
        if hasattr(self.cfg, "num_attention_heads"):
            self.problems += head_problems(self.cfg, self.T)
        self._ends(prefix, base, layers)
        for i, layer in enumerate(layers):
            self._layer(f"{prefix}.layers.{i}", layer)
        if self.problems:
            raise ValueError(f"commfuse.tp.parallelize cannot shard {type(model).__name__} on "
                             f"{self.T} ranks: " + "; ".join(dict.fromkeys(self.problems)))
        return self.plan

    def _ends(self, prefix: str, base: nn.Module, layers: nn.ModuleList) -> None:
        """The embedding, the head, the first layer's shard and the base model's norms."""
        model, ps, styles = self.model, self.ps, self.plan.styles
        embed, head = model.get_input_embeddings(), getattr(model, "lm_head", None)
        names = {id(m): n for n, m in model.named_modules()}
        if not isinstance(head, nn.Linear):
            self.problems.append("lm_head: missing or not an nn.Linear")
            return
        if not isinstance(embed, nn.Embedding):
            self.problems.append(f"the input embedding is {type(embed).__name__}, not an "
                                 f"nn.Embedding")
            return
        if head.out_features < self.T:
            self.problems.append(f"vocab size ({head.out_features}) is below the TP size "
                                 f"({self.T})")
        self.plan.tied = head.weight is embed.weight
        partial = Partial() if self.plan.tied else None
        styles[names[id(embed)]] = (VocabParallelEmbedding(partial) if self.plan.tied
                                    else ReplicateParallel())
        styles["lm_head"] = head_style(model, self.loss_parallel, ps.ag)
        styles[f"{prefix}.layers.0"] = ShardSequence(ps.split, prefetch=ps.chain,
                                                     partial=partial, decode=True)
        for child, mod in base.named_children():
            if mod is embed or mod is layers:
                continue
            for n, sub in mod.named_modules(prefix=f"{prefix}.{child}"):
                if not _has_params(sub):
                    continue
                if _is_norm(sub) and sub.weight.shape[-1] == self.cfg.hidden_size:
                    styles[n] = ps.norm  # the final norm, on the sequence shard
                else:
                    self.problems.append(f"{n} ({type(sub).__name__}) has parameters that no "
                                         f"style covers (not a norm over the hidden size)")
        for n, mod in model.named_modules():
            if _has_params(mod) and n not in ("lm_head", names[id(embed)]) and not (
                    n == prefix or n.startswith(prefix + ".")):
                self.problems.append(f"{n} ({type(mod).__name__}) has parameters outside the "
                                     f"base model that no style covers")
        if _has_params(base):
            self.problems.append(f"{prefix} has parameters of its own that no style covers")

    def _layer(self, p: str, layer: nn.Module) -> None:
        cols: dict[str, list[str]] = {}  # parent -> its column-parallel children (leaf names)
        norms, covered = [], []  # covered: submodules a WHOLE handler planned
        for name, mod in layer.named_modules():
            if any(name == c or name.startswith(c + ".") for c in covered):
                continue
            where = f"{p}.{name}" if name else p
            handler = next((getattr(self, h) for test, h in WHOLE if test(mod)), None)
            if handler is not None:
                children = handler(where, mod)
                if children is None:
                    children = [c for c, _ in mod.named_children()]
                covered += [f"{name}.{c}" if name else c for c in children]
            elif isinstance(mod, nn.Linear):
                role = self.roles.get(name) or BY_NAME.get(name.rpartition(".")[2])
                if role == "col":
                    parent, _, leaf = name.rpartition(".")
                    cols.setdefault(parent, []).append(leaf)
                elif role == "row":
                    self.plan.styles[where] = self.ps.row
                else:
                    self.problems.append(f"{where}: an nn.Linear that neither the config's "
                                         f"base_model_tp_plan nor its name "
                                         f"({', '.join(BY_NAME)}) marks column- or row-parallel")
            elif _has_params(mod):
                if _is_norm(mod):
                    norms.append((name, mod))
                elif self._per_head(mod):  # attention sinks: split with the heads
                    self.plan.head_params.append(where)
                elif all(t.numel() == 1 for t in mod.parameters(recurse=False)):
                    # scalars (an activation's, Apertus' xIELU): per element wherever it
                    # runs, so replicated with its gradient summed over TP
                    self.plan.styles[where] = self.ps.norm
                else:
                    self.problems.append(f"{where} ({type(mod).__name__}) has parameters "
                                         f"{sorted(n for n, _ in mod.named_parameters(recurse=False))} "
                                         f"that no style covers and is not known to be per token")
        for parent, leaves in cols.items():
            if not parent:
                self.problems.append(f"{p}: column-parallel linears {leaves} directly on the "
                                     f"layer (the plan fuses those of one attention or MLP)")
                continue
            self._projections(p, layer, parent, leaves)
        for name, mod in norms:
            self._norm(p, layer, name, mod, cols)

    def _deltanet(self, where: str, mixer: nn.Module) -> None:
        """A Gated DeltaNet mixer: `DeltaNetParallel` (in_proj AG->GEMM, conv, rule and
        gated norm on this rank's heads), out_proj row-parallel, the norm's weight replicated."""
        try:
            deltanet_layout(mixer, self.T, where)
        except ValueError as e:
            self.problems.append(str(e))
            return
        self.plan.styles.update({where: DeltaNetParallel(prefetch=self.ps.chain, **self.ps.ag),
                                 f"{where}.out_proj": self.ps.row,
                                 f"{where}.norm": self.ps.norm})

    def _mamba(self, where: str, mixer: nn.Module) -> None:
        """A Mamba-2 mixer: `MambaMixerParallel` (in_proj AG->GEMM, conv, scan and gated norm
        on this rank's heads), out_proj row-parallel."""
        try:
            mixer_layout(mixer, self.T, where)
        except ValueError as e:
            self.problems.append(str(e))
            return
        self.plan.styles.update({where: MambaMixerParallel(prefetch=self.ps.chain, **self.ps.ag),
                                 f"{where}.out_proj": self.ps.row})

    def _projections(self, p: str, layer: nn.Module, parent: str, leaves: list[str]) -> None:
        """One fused all-gather for the column-parallel children of ``parent``."""
        ps, styles, T = self.ps, self.plan.styles, self.T
        owner, where = layer.get_submodule(parent), f"{p}.{parent}"
        is_attention = any(leaf in ATTENTION for leaf in leaves)
        if not is_attention and "Attention" in type(owner).__name__:
            self.problems.append(f"{where} ({type(owner).__name__}): an attention whose "
                                 f"projections {leaves} are not {'/'.join(ATTENTION)}, so the "
                                 f"plan cannot tell how they hold its heads")
            return
        if is_attention:
            self.plan.attention.append(owner)
            problems = attention_problems(owner, where, self.cfg, T)
            if problems:
                self.problems += problems
                return
        for leaf in leaves:
            lin = owner.get_submodule(leaf)
            if leaf in KV and is_attention:
                style = FusedColwiseParallel(replicas=kv_replicas(self.cfg, T, owner), **ps.ag)
            elif PACKED.get(leaf) == "q|k|v":
                _, G = head_counts(self.cfg)
                if G % T:
                    self.problems.append(f"{where}.{leaf}: a packed q|k|v with "
                                         f"{G} kv heads cannot be split over {T} ranks (kv "
                                         f"heads replicated inside a packed projection are "
                                         f"not built)")
                    continue
                style = FusedColwiseParallel(rows=packed_qkv_rows(self.cfg, self.head_dim, T),
                                             **ps.ag)
            elif PACKED.get(leaf) == "gate|up":
                if lin.out_features % (2 * T):
                    self.problems.append(f"{where}.{leaf}: a packed gate|up of "
                                         f"{lin.out_features} rows cannot be split into equal "
                                         f"halves over {T} ranks")
                    continue
                style = FusedColwiseParallel(rows=halves_rows(lin.out_features, T), **ps.ag)
            else:
                style = ps.col
            styles[f"{where}.{leaf}"] = style
        styles[where] = FusedProjections(tuple(leaves), prefetch=ps.chain, **ps.ag)

    def _norm(self, p: str, layer: nn.Module, name: str, mod: nn.Module, cols) -> None:
        parent, _, leaf = name.rpartition(".")
        where, width = f"{p}.{name}", mod.weight.shape[-1]
        if not parent:  # on the residual stream: per token, on the sequence shard
            if width == self.cfg.hidden_size:
                self.plan.styles[where] = self.ps.norm
            else:
                self.problems.append(f"{where}: a norm of width {width} on the residual "
                                     f"stream (hidden size {self.cfg.hidden_size})")
            return
        siblings = cols.get(parent, [])
        owner = layer.get_submodule(parent)
        if width == self.head_dim and any(s in ATTENTION for s in siblings):
            self.plan.styles[where] = self.ps.norm  # per head, on this rank's heads
            return
        widths = {s: owner.get_submodule(s).out_features for s in siblings}
        proj = leaf.replace("_norm", "_proj").replace("_layernorm", "_proj")
        match = proj if widths.get(proj) == width else next(
            iter([s for s, w in widths.items() if w == width]), None)
        if match is not None and match not in PACKED and rms_norm_like(mod):
            k = kv_replicas(self.cfg, self.T, owner) if match in KV else 1
            self.plan.styles[where] = SplitDimNorm(replicas=k)
            return
        self.problems.append(f"{where} ({type(mod).__name__}, width {width}): a norm inside "
                             f"{parent} that is neither per head (head_dim {self.head_dim}) nor "
                             f"an RMSNorm over a column-parallel projection's output")

    def _mla(self, where: str, attn: nn.Module) -> None:
        styles, problems = mla_plan(attn, where, self.cfg, self.T, self.ps)
        self.plan.styles.update(styles)
        self.problems += problems
        self.plan.attention.append(attn)

    def _per_head(self, mod: nn.Module) -> bool:
        """Whether ``mod`` is an attention whose own parameters are one value per head."""
        H = head_counts(self.cfg)[0] if hasattr(self.cfg, "num_attention_heads") else 0
        return (any(isinstance(getattr(mod, a, None), nn.Linear) for a in ATTENTION)
                and all(t.dim() == 1 and t.shape[0] == H
                        for t in mod.parameters(recurse=False)))

    def _sparse(self, where: str, block: nn.Module) -> list[str]:
        """The experts split over the ranks (`ExpertParallel`), the router replicated; a
        one-output linear beside them (a shared expert's sigmoid gate) and the `PER_TOKEN`
        linears replicated per token; the block's other children (shared experts) are left
        to the plan's walk."""
        spec = expert_spec(block)
        self.problems += [f"{where}: {p}" for p in self.moe.problems(spec, self.T)]
        for knob in ROUTER_EXTRAS:
            if getattr(self.cfg, knob, 0):
                self.problems.append(f"unsupported config: {knob}={getattr(self.cfg, knob)}")
        self.plan.styles[where] = self.moe
        covered = ["experts", spec.router]
        for name, child in block.named_children():
            if isinstance(child, nn.Linear) and (name in PER_TOKEN or (
                    child.out_features == 1
                    and not self.roles.get(f"{where.split('.', 3)[-1]}.{name}"))):
                self.plan.styles[f"{where}.{name}"] = self.ps.norm
                covered.append(name)
        return covered


def derive_plan(model: nn.Module, T: int, ps: PlanStyles | None = None,
                loss_parallel: bool = False, moe=None) -> Plan:
    """The `Plan` of ``model`` on ``T`` ranks (``ps``: the styles, default ``method="none"``);
    a ValueError naming every module it cannot cover. Changes nothing."""
    ps = ps or plan_styles("none", False, False, {})
    moe = moe or ExpertParallel(split=ps.split, method="none")
    try:
        return _Deriver(model, T, ps, loss_parallel, moe).derive()
    except ValueError:
        raise
    except Exception as e:  # a model whose parts the walk misreads: refused, not crashed
        raise ValueError(f"commfuse.tp.parallelize cannot plan {type(model).__name__}: reading "
                         f"its modules and config failed ({type(e).__name__}: {e})") from e
