"""The config groups `python -m tonpolicy --help` lists: Hydra's list without the base_<group> schemas.

Hydra's help template offers only `$APP_CONFIG_GROUPS`, every option of every group, the schemas the
options extend (base_contract, ...) among them, though they are no choice for a user. The template in
conf/config.yaml calls this resolver instead.
"""

from __future__ import annotations

from omegaconf import OmegaConf

RESOLVER = "tonpolicy_config_groups"


def register_help_resolver() -> None:
    OmegaConf.register_new_resolver(RESOLVER, config_groups_help, replace=True)


def config_groups_help() -> str:
    """One line per group, `group: option, option`, as Hydra writes them (its own groups left out)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()

    def groups(parent: str) -> list[str]:
        found = []
        for name in loader.list_groups(parent):
            group = f"{parent}/{name}" if parent else name
            if loader.get_group_options(group, ObjectType.CONFIG):
                found.append(group)
            if loader.get_group_options(group, ObjectType.GROUP):
                found.extend(groups(group))
        return found

    lines = []
    for group in sorted(g for g in groups("") if g != "hydra" and not g.startswith("hydra/")):
        options = [o for o in sorted(loader.get_group_options(group)) if not o.startswith("base_")]
        lines.append(f"{group}: {', '.join(options)}")
    return "\n".join(lines) + "\n"
