""".env.example and the README's configuration table stay in step with config/settings.py."""

from __future__ import annotations

import re

from config.settings import PROJECT_DIR, Settings


def _variables() -> list[str]:
    names = []
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        choices = getattr(alias, "choices", None)
        names.append(str(choices[0]) if choices else name.upper())
    return names


def test_env_example_lists_every_setting_with_a_comment() -> None:
    lines = (PROJECT_DIR / ".env.example").read_text().splitlines()
    for name in _variables():
        found = [i for i, line in enumerate(lines) if re.match(rf"^(# )?{name}=", line)]
        assert found, f"{name} is missing from .env.example"
        assert lines[found[0] - 1].startswith("#"), f"{name} needs a comment line above it"


def test_env_example_values_are_the_defaults(monkeypatch) -> None:
    for name in _variables():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MODEL_REPO", raising=False)
    from_example = Settings(_env_file=PROJECT_DIR / ".env.example")
    assert from_example.model_dump() == Settings(_env_file=None).model_dump()


def test_readme_configuration_table_names_every_setting() -> None:
    readme = (PROJECT_DIR / "README.md").read_text()
    rows = set(re.findall(r"^\| `([A-Z_]+)` \|", readme, flags=re.MULTILINE))
    missing = [name for name in _variables() if name not in rows]
    assert not missing, f"README's configuration table lacks {missing}"
    unknown = rows - set(_variables()) - {"MODEL_REPO"}
    assert not unknown, f"README documents settings that do not exist: {sorted(unknown)}"
