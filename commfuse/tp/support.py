"""docs/support.md's generated sections: `support_matrix`, the families of
`commfuse.tp.families` against what takes each (read from where the code decides it: the
shipped ``--hf-config`` files, the model types `commfuse generate` loads, the model types
`commfuse plan` prices), and `sweep_section`, scripts/family_sweep.py's docs/support-sweep.csv.
``python -m commfuse.tp.support`` prints the matrix; ``--write`` puts both in docs/support.md.
"""

from __future__ import annotations

from commfuse.tp.families import COMPILED, FAMILIES, FSDP2, GENERATE, tiny_config


def _shipped() -> dict[tuple[str, bool], list[str]]:
    """(model_type, tied embeddings) -> the shipped ``--hf-config`` names."""
    from transformers import AutoConfig

    from commfuse.data import DATA_DIR
    names: dict[tuple[str, bool], list[str]] = {}
    for path in sorted((DATA_DIR / "hf").glob("*.json")):
        cfg = AutoConfig.from_pretrained(str(path))
        names.setdefault((cfg.model_type, bool(cfg.tie_word_embeddings)), []).append(path.stem)
    return names


def support_matrix() -> str:
    """docs/support.md's table: each family against what takes it."""
    from commfuse.models.llama import HF_TYPES
    from commfuse.sim.plan.hf_config import PLANNED_TYPES
    shipped = _shipped()
    rows = [(n, f.model_type, f.test, bool(tiny_config(n).tie_word_embeddings))
            for n, f in FAMILIES.items()]
    yes = lambda ok: "yes" if ok else "-"  # noqa: E731
    lines = ["| family | model_type | `parallelize` | `train --hf-config` | generate | `plan` "
             "| `torch.compile` | FSDP2 |", "|---|---|---|---|---|---|---|---|"]
    for name, kind, test, tied in rows:
        cfgs = [c for (k, t), cs in shipped.items() if k == kind and tied in (None, t)
                for c in cs]
        cfgs = ", ".join(f"`{c}`" for c in cfgs) or "a config.json of it"
        gen = "`commfuse generate`" + (" (own Llama)" if kind in HF_TYPES else "")
        gen += ", `model.generate` tested" if name in GENERATE else ""
        lines.append(f"| {name} | `{kind}` | yes ({test}) | {cfgs} | {gen} "
                     f"| {yes(kind in PLANNED_TYPES)} | {yes(name in COMPILED)} "
                     f"| {yes(name in FSDP2)} |")
    return "\n".join(lines) + "\n"


def sweep_section(path) -> str:
    """docs/support.md's sweep section: scripts/family_sweep.py's CSV at ``path``, each
    model type under its outcome."""
    import csv
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["status"], []).append(r)
    versions = ", ".join(sorted({r["transformers"] for r in rows}))
    lines = [f"`scripts/family_sweep.py` on transformers {versions}: {len(rows)} causal-LM "
             f"model types, each a tiny float32 model on 2 ranks under methods `none` and "
             f"`commfuse` against the unsharded model (logits, loss, every gradient).", ""]
    for status, what in (("exact", "checked exact"), ("MISMATCH", "MISMATCH"),
                         ("error", "error"), ("refused", "refused"), ("skipped", "skipped")):
        rs = by.get(status, [])
        if status == "exact":
            lines.append(f"- {what} ({len(rs)}): "
                         + ", ".join(f"`{r['model_type']}`" for r in rs))
            continue
        lines.append(f"- {what} ({len(rs)}){':' if rs else ''}")
        lines += [f"  - `{r['model_type']}`: {r['detail'].split('; ')[0]}" for r in rs]
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- support-matrix: generated, do not edit -->\n", "<!-- end support-matrix -->"
SWEEP = "<!-- family-sweep: generated, do not edit -->\n", "<!-- end family-sweep -->"


def sections(docs) -> dict[tuple[str, str], str]:
    """docs/support.md's generated sections (``docs``: the docs folder): markers -> text."""
    from pathlib import Path
    return {(BEGIN, END): support_matrix(),
            SWEEP: sweep_section(Path(docs) / "support-sweep.csv")}


def write_support(path) -> None:
    """Replace each generated section of ``path`` (docs/support.md) between its markers."""
    from pathlib import Path
    doc = Path(path).read_text()
    for (begin, end), text in sections(Path(path).parent).items():
        head, rest = doc.split(begin)
        doc = head + begin + text + end + rest.split(end, 1)[1]
    Path(path).write_text(doc)


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["--write"]:
        write_support(sys.argv[2] if len(sys.argv) > 2 else "docs/support.md")
    else:
        print(support_matrix(), end="")
