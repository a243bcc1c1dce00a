"""A configuration's problems as the user reads them (key, value, rule), and the keys the schema lacks.

Here, below everything that reports them, so the composer and the launcher raise the same error as
validation (tonpolicy.validation.validate)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from tonpolicy.config.schema import Config


@dataclass(frozen=True)
class ConfigIssue:
    key: str
    value: Any
    rule: str

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}: {self.rule}"


class ConfigError(ValueError):
    def __init__(self, issues: list[ConfigIssue]):
        self.issues = issues
        lines = "\n".join(f"  - {i}" for i in issues)
        super().__init__(f"invalid configuration ({len(issues)} problem(s)):\n{lines}")


def unknown_keys(composed: Any) -> list[ConfigIssue]:
    """Keys of a composed config (a DictConfig, e.g. after `+experiment.temprature=0.5`) that the
    schema does not have; converting to the dataclasses would silently drop them."""
    from omegaconf import OmegaConf

    found: list[ConfigIssue] = []

    def walk(node: dict, ref: dict, prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if key not in ref:
                close = difflib.get_close_matches(str(key), [str(k) for k in ref], n=1)
                hint = f"; did you mean {prefix}{close[0]}?" if close else ""
                found.append(ConfigIssue(dotted, value, f"unknown key (not in the schema){hint}"))
            elif isinstance(value, dict) and isinstance(ref[key], dict) and ref[key]:
                walk(value, ref[key], dotted + ".")  # an empty mapping in the schema is the user's to fill

    walk(
        OmegaConf.to_container(composed, resolve=False),
        OmegaConf.to_container(OmegaConf.structured(Config), resolve=False),
        "",
    )
    return found
