"""docs/config.md is what `scripts/gen_config_docs.py` makes of the config models now; every key has a description."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pydantic import BaseModel

from relax_gym.trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
assert _spec is not None and _spec.loader is not None
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def _models(model: type[BaseModel], seen: list[type[BaseModel]]) -> list[type[BaseModel]]:
    """`model` and every model its fields hold, however nested (`M | None`, `list[M]`)."""
    if model not in seen:
        seen.append(model)
        for field in model.model_fields.values():
            found = gen._section_of(field.annotation)
            if found is not None:
                _models(found[0], seen)
    return seen


def test_the_page_is_current():
    path = ROOT / "docs" / "config.md"
    page = path.read_text(encoding="utf-8") if path.is_file() else ""
    assert page == gen.render(), f"docs/config.md is stale: run {gen.REGENERATE}"


def test_every_field_of_every_section_has_a_description():
    models = _models(TrainConfig, [])
    assert len(models) > 10  # the walk reaches the nested sections (cluster.health, trainer.megatron, ...)
    missing = [f"{m.__name__}.{name}" for m in models for name, field in m.model_fields.items()
               if not (field.description or "").strip()]
    assert not missing, f"fields without Field(description=...): {missing}"


def test_types_and_defaults_read_as_a_config_spells_them():
    from typing import Literal

    assert gen.type_name(Literal["sync", "async"]) == '"sync" | "async"'
    assert gen.type_name(float | None) == "float | None"
    assert gen.type_name(list[int]) == "list[int]"
    assert [gen.yaml_value(v) for v in (None, True, 1e-5, [], "runs/default")] == [
        "null", "true", "1.0e-05", "[]", "runs/default"]
