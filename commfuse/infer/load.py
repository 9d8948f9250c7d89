"""A whole `Llama` from a checkpoint of ``commfuse train``, whatever its TP / UP / DP layout
(`load_llama`), or from a transformers Llama, Mistral, Qwen2 or Qwen3 saved with
``save_pretrained`` or by ``commfuse train --hf-config --checkpoint-dir`` (`load_hf`;
`load_checkpoint_model` tells the two kinds of checkpoint apart).

`commfuse.parallel.checkpoint` stores every rank's shards under its own key (``rank<i>.model.
...``) with the layout in ``meta.json``; this reads them all in one process (no process group)
and puts each weight back together by the rules `commfuse.parallel.plan` cut it by (rank
i = dp_index * seq + seq_index):

    seq axis (tp or up > 1)  embedding and output head: rows (vocabulary); under TP wq / wk /
                             wv / w_gate / w_up rows, wo / w_down columns; under UP the
                             attention's weights are whole (wqkv in `permute_qkv`'s order)
    dp axis (dp > 1)         every projection's rows (of its seq shard), the head's too unless
                             its seq shard's rows do not divide by dp; norms and the embedding
                             are replicated
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from commfuse.models.llama import Llama, LlamaConfig

PROJ = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down")


def checkpoint_path(root: str | Path) -> Path:
    """The checkpoint ``root/latest`` names, or ``root`` itself if it is one (has meta.json,
    or config.json: a transformers model directory)."""
    root = Path(root)
    if (root / "meta.json").is_file() or (root / "config.json").is_file():
        return root
    if (root / "latest").is_file():
        return root / (root / "latest").read_text().strip()
    raise FileNotFoundError(f"{root}: no checkpoint (neither latest nor meta.json; written by "
                            "commfuse train --checkpoint-dir)")


def _read_shards(path: Path, world: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's model tensors, under the reference model's names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    want = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
            if isinstance(m, TensorStorageMetadata) and ".model." in k.split("optim")[0]
            and k.split(".", 1)[1].startswith("model.")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(want, checkpoint_id=str(path), no_dist=True)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for key, t in want.items():
        rank, name = key.split(".", 1)
        name = name.removeprefix("model.").removeprefix("model.")  # checkpoint / ParallelLlama
        shards[int(rank.removeprefix("rank"))][name.replace("output.w.weight", "output.weight")] = t
    return shards


def _qkv_order(cfg: LlamaConfig, up: int) -> torch.Tensor:
    """Which row of [wq; wk; wv] each row of UP's wqkv is."""
    from commfuse.parallel.ulysses import permute_qkv

    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    idx = torch.arange(q + 2 * kv, dtype=torch.float64)[:, None]
    return permute_qkv(idx[:q], idx[q:q + kv], idx[q + kv:], up)[:, 0].long()


def load_llama(root: str | Path, dtype: torch.dtype | None = None) -> tuple[Llama, dict]:
    """The unsharded Llama of the checkpoint at ``root`` (a directory of ``commfuse train
    --checkpoint-dir``, or one of its step directories) and the run's layout meta."""
    path = checkpoint_path(root)
    meta = json.loads((path / "meta.json").read_text())
    if "preset" not in meta:
        raise ValueError(f"{path}: not a checkpoint of the Llama presets (meta {meta})")
    tp, up, dp = meta["tp"], meta["up"], meta["dp"]
    seq = max(tp, up)
    cfg = LlamaConfig.preset(meta["preset"], **meta.get("model", {}))
    shards = _read_shards(path, meta["world"])
    with torch.device("meta"):
        model = Llama(cfg)
    full_shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
    state: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        if name.endswith("wqkv.weight") or name not in full_shapes and up == 1:
            continue
        state[name] = _assemble(name, shards, tp, up, dp, seq, cfg)
    if up > 1:  # UP kept the attention whole, its q|k|v permuted in one matrix
        for i in range(cfg.n_layers):
            pre = f"layers.{i}.attn."
            wqkv = torch.cat([s[pre + "wqkv.weight"] for s in shards[::seq]], 0) if dp > 1 \
                else shards[0][pre + "wqkv.weight"]
            rows = torch.empty_like(wqkv)
            rows[_qkv_order(cfg, up)] = wqkv
            q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
            state[pre + "wq.weight"], state[pre + "wk.weight"], state[pre + "wv.weight"] = \
                rows.split([q, kv, kv])
    if cfg.tie_embeddings:
        state.pop("output.weight", None)
    missing = {n for n in full_shapes if n not in state} - (
        {"output.weight"} if cfg.tie_embeddings else set())
    wrong = {n: (tuple(state[n].shape), tuple(full_shapes[n])) for n in state
             if n in full_shapes and state[n].shape != full_shapes[n]}
    if missing or wrong:
        raise ValueError(f"{path}: cannot rebuild the model (meta {meta}): missing {missing}, "
                         f"wrong shapes {wrong}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_emb.weight
    return (model if dtype is None else model.to(dtype)), meta


def _assemble(name: str, shards, tp: int, up: int, dp: int, seq: int,
              cfg: LlamaConfig) -> torch.Tensor:
    """One weight put back together over the dp axis (inner), then the seq axis."""
    proj = any(name.endswith(p + ".weight") for p in PROJ)
    seq_dim = None
    if seq > 1 and name in ("tok_emb.weight", "output.weight"):
        seq_dim = 0
    elif tp > 1 and proj:
        seq_dim = 1 if name.endswith(("attn.wo.weight", "mlp.w_down.weight")) else 0
    if name == "output.weight":
        rows = cfg.vocab_size // seq
        dp_split = dp > 1 and (rows % dp == 0 if seq > 1 else True)
    else:
        dp_split = dp > 1 and proj
    parts = []
    for s in range(seq if seq_dim is not None else 1):
        mine = [shards[d * seq + s][name] for d in range(dp)]
        parts.append(torch.cat(mine, 0) if dp_split else mine[0])
    return torch.cat(parts, seq_dim) if seq_dim is not None else parts[0]


def is_hf_checkpoint(root: str | Path) -> bool:
    """Whether the checkpoint at ``root`` (`checkpoint_path`) is a transformers model directory
    (``commfuse train --hf-config``) rather than a sharded one of the built-in Llama."""
    path = checkpoint_path(root)
    return (path / "config.json").is_file() and not (path / "meta.json").is_file()


def load_checkpoint_model(root: str | Path, dtype: torch.dtype | None = None):
    """(model, its dtype) of the checkpoint at ``root``, either kind (`is_hf_checkpoint`):
    the built-in Llama's in the dtype it trained in (`load_llama`), a transformers one's in
    its saved dtype (`load_hf`); ``dtype`` instead if given."""
    if is_hf_checkpoint(root):
        model = load_hf(checkpoint_path(root), dtype)
        return model, model.tok_emb.weight.dtype
    from commfuse.train.config import DTYPES

    model, meta = load_llama(root)
    dtype = dtype or DTYPES[meta.get("dtype", "float32")]
    return model.to(dtype), dtype


def check_hf(path: str | Path, tokenize: bool = False):
    """The `LlamaConfig` of the transformers model saved in ``path``; ValueError, saying why,
    if it cannot be read or `commfuse.models.llama.from_hf` does not model it (other
    architectures, an o_proj or MLP bias, other RoPE, another head_dim), or (``tokenize``)
    if it has no tokenizer of its own and its vocabulary is smaller than commfuse's
    tokenizer's."""
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise ValueError(f"reading {path} needs transformers (pip install 'commfuse[hf]')") from e
    from commfuse.models.llama import config_from_hf

    try:
        hf = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a transformers model directory ({e})") from e
    try:
        cfg = config_from_hf(hf)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    if tokenize and hf_tokenizer(path) is None:
        from commfuse.data import load_tokenizer

        have = load_tokenizer().get_vocab_size()
        if cfg.vocab_size < have:
            raise ValueError(f"{path} has no tokenizer and a vocabulary of {cfg.vocab_size} "
                             f"tokens, below commfuse's tokenizer's {have}: save its "
                             f"tokenizer there (save_pretrained)")
    return cfg


def load_hf(path: str | Path, dtype: torch.dtype | None = None) -> Llama:
    """Our `Llama` with the weights of the transformers Llama, Mistral, Qwen2 or Qwen3 saved in
    ``path`` (``save_pretrained``: config.json and its weights), by
    `commfuse.models.llama.from_hf`: the same weights, biases, q/k norms, sliding windows
    and rotate-half RoPE, so its logits are the transformers model's (`check_hf` first)."""
    check_hf(path)
    from transformers import AutoModelForCausalLM

    from commfuse.models.llama import from_hf

    return from_hf(AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype or "auto"))


class HFTokenizer:
    """A transformers tokenizer behind the `tokenizers.Tokenizer` calls `commfuse generate`
    makes (``encode(text).ids``, ``decode(ids)``)."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str):
        return SimpleNamespace(ids=list(self.tok.encode(text, add_special_tokens=True)))

    def decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def hf_tokenizer(path: str | Path) -> HFTokenizer | None:
    """The tokenizer saved beside the model in ``path``, or None if there is none."""
    if not any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                   "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(path))
