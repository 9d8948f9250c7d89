"""The lists the docs spell out are the code's: the method variants (docs/api.md) and the
shipped configs that `commfuse generate` serves (docs/inference.md)."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _paragraph(page: str, start: str) -> str:
    """The paragraph of ``page`` that begins with ``start``."""
    text = (ROOT / page).read_text(encoding="utf-8")
    at = text.index(start)
    return text[at:text.find("\n\n", at)]


def test_api_lists_every_variant_in_order():
    from commfuse.schedule import VARIANTS

    listed = re.findall(r"`([\w-]+)`", _paragraph("docs/api.md", "`commfuse.schedule.VARIANTS`"))
    assert listed[1:] == list(VARIANTS)  # the first is the table's own name


def test_inference_names_the_shipped_configs_that_generate():
    from commfuse.data import DATA_DIR
    from commfuse.models.llama import HF_TYPES

    types = {p.stem: json.loads(p.read_text())["model_type"]
             for p in (DATA_DIR / "hf").glob("*.json")}
    text = _paragraph("docs/inference.md", "`generate` takes the transformers families")
    own, others = text.split("The MoE configs")
    named = lambda part: set(re.findall(r"`([\w.-]+-tiny)`", part))
    why = ("docs/inference.md, 'Architectures': name each shipped config (commfuse/data/hf), "
           "those whose model_type is in HF_TYPES before 'The MoE configs', the others after")
    assert named(own) == {name for name, t in types.items() if t in HF_TYPES}, why
    assert named(others) == {name for name, t in types.items() if t not in HF_TYPES}, why
