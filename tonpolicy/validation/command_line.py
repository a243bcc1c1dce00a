"""Check a `python -m tonpolicy ...` command line before Hydra acts on it.

Hydra reports a bad command line in its own words (or a traceback) and exits 1, one problem at a
time, and only after it has made the sweep folder. Everything Hydra would trip on is checked here
first, in tonpolicy's format (`ConfigIssue`, every problem at once), before anything is written or
started: options of a group, keys the schema lacks (written with or without `+`), values of the
wrong type, overrides Hydra cannot parse, sweeps without `-m`, and the run (or sweep) folder.
Whatever else Hydra refuses is found by composing each job as Hydra will.

A group or key given twice with different values is no error: as in Hydra, the last one stands (a
wrapper script ending in `"$@"` relies on it), and a warning names the key and its values. Every value
given is still checked, a superseded one too: a typo is reported wherever it is. A sweep follows the
same rule, as Hydra's sweeper does (it keeps one entry per key, the last): `-m parallel=tp1,tp2
parallel=tp4` runs one job, with tp4, and `-m parallel=tp1 parallel=tp2,tp4` sweeps tp2 and tp4; one
rule for every override is less surprising than an exception for sweeps.
"""

from __future__ import annotations

import argparse
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import BooleanNode, EnumNode, FloatNode, IntegerNode, StringNode

from tonpolicy.config.compose import CONF_DIR
from tonpolicy.config.errors import ConfigError, ConfigIssue, unknown_keys
from tonpolicy.config.schema import GROUPS, Config, register_configs

CONFIG_NAME = "config"
COMMAND_LINE = "command line"  # the key of a problem that is no config key (a flag, the whole line)
_EXPECTED = {
    IntegerNode: "an integer",
    FloatNode: "a number",
    BooleanNode: "true or false",
    StringNode: "a string",
}
_ITEMS = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


class _ArgvError(Exception):
    pass


def _parser_error(message: str) -> NoReturn:
    # argparse would print its usage and exit; the message becomes one problem among the others.
    raise _ArgvError(message)


def check_command_line(argv: list[str]) -> list[str]:
    """Raise ConfigError listing every problem of `argv` (sys.argv[1:]); when Hydra may run, return the
    warnings (a key given twice), one line each."""
    issues, warnings = command_line_findings(argv)
    if issues:
        raise ConfigError(issues)
    return warnings


def command_line_problems(argv: list[str]) -> list[ConfigIssue]:
    return command_line_findings(argv)[0]


def command_line_findings(argv: list[str]) -> tuple[list[ConfigIssue], list[str]]:
    """(the problems that stop the line, the warnings that do not)."""
    from hydra._internal.utils import get_args_parser

    if any(a in ("--version", "--shell-completion", "-sc", "--hydra-help") for a in argv):
        return [], []  # Hydra's own commands: nothing of tonpolicy's is composed
    parser = get_args_parser()
    parser.error = _parser_error  # type: ignore[method-assign]
    try:
        args = parser.parse_args(argv)
    except _ArgvError as exc:
        return [ConfigIssue(COMMAND_LINE, " ".join(argv), f"{exc} (see python -m tonpolicy --help)")], []
    # Hydra raises these two as bare exceptions, after it has set itself up.
    if args.resolve and not (args.cfg or args.help):
        return [ConfigIssue(COMMAND_LINE, "--resolve", "only with --cfg or --help")], []
    flags = {"--run": args.run, "--multirun": args.multirun, "--cfg": args.cfg, "--info": args.info}
    commands = [flag for flag, given in flags.items() if given]
    if len(commands) > 1:
        return [ConfigIssue(COMMAND_LINE, " ".join(commands), "give one of them")], []
    check = _Check(args)
    return check.run(), check.warnings


@dataclass
class _Check:
    args: argparse.Namespace
    issues: list[ConfigIssue] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def run(self) -> list[ConfigIssue]:
        from hydra.core.utils import JobRuntime, setup_globals
        from hydra.errors import HydraException

        register_configs()
        setup_globals()  # ${now:...} in the run folder's name
        JobRuntime.instance().set("name", "__main__")  # what composition names the job; Hydra sets it again
        a = self.args
        self.config_name = a.config_name or CONFIG_NAME
        self.multirun = bool(a.multirun)
        self.composed: DictConfig | None = None
        try:
            self.loader = _loader(a.config_path, a.config_dir)
            parsed = self._parse(a.overrides)
            _, self.repo = self.loader._parse_overrides_and_create_caching_repo(
                self.config_name, [p.input_line for p in parsed if p.is_hydra_override()]
            )
            self.multirun = self.multirun or _asks_multirun(self.repo, self.config_name, parsed)
            self._check_overrides(parsed)
        except (HydraException, OmegaConfBaseException, OSError) as exc:
            self.issues.append(ConfigIssue(COMMAND_LINE, " ".join(a.overrides), _first_lines(exc)))
            return self.issues
        if not self.issues:
            self._compose_every_job(parsed)
        creates_folder = not (a.help or a.cfg or a.info)
        if creates_folder:
            self._check_output_dir([p.input_line for p in parsed if p.input_line not in self.bad_lines])
        return self.issues

    # -- parsing ------------------------------------------------------------------------------------

    def _parse(self, overrides: list[str]) -> list[Any]:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.errors import OverrideParseException

        self.bad_lines: set[str] = set()
        parser = OverridesParser.create(config_loader=self.loader)
        parsed = []
        for line in overrides:  # one at a time, so every malformed one is named
            try:
                parsed.extend(parser.parse_overrides([line]))
            except OverrideParseException as exc:
                key, _, value = line.partition("=")
                self.bad_lines.add(line)
                said = [ln for ln in str(exc).splitlines() if not ln.startswith(("Error parsing", "See https"))]
                why = (said or ["Hydra's override grammar"])[0].split(" expecting ")[0]
                if why.startswith("LexerNoViableAltException"):
                    why = "a character Hydra's grammar cannot read: an unclosed quote?"
                self.issues.append(
                    ConfigIssue(
                        key,
                        value,
                        f"not a valid override ({why}); write key=value, quoting a value that holds"
                        " spaces or any of = , [ ] { } ( ) ' \"",
                    )
                )
        return parsed

    def _check_overrides(self, parsed: list[Any]) -> None:
        from hydra.core.object_type import ObjectType

        self.groups = sorted(GROUPS)
        self.schema = OmegaConf.structured(Config)
        self._warn_repeats(parsed)
        for ov in parsed:
            key, line = ov.key_or_group, ov.input_line
            before = len(self.issues)
            if ov.is_sweep_override() and not self.multirun:
                self.issues.append(
                    ConfigIssue(
                        key,
                        _shown(ov),
                        "a sweep needs -m (--multirun); for a list write key=[a,b], for a string quote it",
                    )
                )
            elif ov.is_hydra_override() or ov.is_delete():
                pass  # Hydra's own settings: checked by composing (below)
            elif key in self.groups:
                options = self.repo.get_group_options(key, ObjectType.CONFIG)
                for value in _values(ov):
                    if str(value) not in options:
                        self.issues.append(ConfigIssue(key, value, self._unknown_option(key, str(value), options)))
            elif "/" not in key:
                self._check_key(ov)
            if len(self.issues) > before:
                self.bad_lines.add(line)

    def _warn_repeats(self, parsed: list[Any]) -> None:
        """A key given more than once with different values: the last stands (see the module's docstring)."""
        given: dict[str, list[str]] = {}
        for ov in parsed:
            given.setdefault(ov.key_or_group, []).append(ov.input_line)
        for key, lines in given.items():
            if len({line.partition("=")[2] for line in lines}) < 2:
                continue  # the same value again changes nothing
            times = "twice" if len(lines) == 2 else f"{len(lines)} times"
            self.warnings.append(f"{key} is given {times} ({', then '.join(lines)}); the last one stands: {lines[-1]}")

    def _unknown_option(self, group: str, value: str, options: list[str]) -> str:
        shown = [o for o in options if not o.startswith("base_")]  # the schemas the options extend
        close = difflib.get_close_matches(value, shown, n=1)
        hint = f"; did you mean {group}={close[0]}?" if close else ""
        folders = " and ".join(self._folders(group))
        return f"no such option of the {group} group{hint} (options: {', '.join(shown)}; from {folders})"

    def _folders(self, group: str) -> list[str]:
        found = []
        for source in self.repo.get_sources():
            if source.scheme() not in ("file", "pkg") or source.provider == "hydra":
                continue
            path = source.path
            if Path(path) == CONF_DIR:
                path = "tonpolicy/conf"
            found.append(f"{path}/{group}/")
        return found

    def _check_key(self, ov: Any) -> None:
        key = ov.key_or_group
        node: Any = self.schema
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, DictConfig):
                return  # a list index or a value below a value: composition decides
            if part not in node:
                nested: Any = _shown(ov)
                for p in reversed(parts):
                    nested = {p: nested}
                # The same words as a `+key=...` that composition lets through (one code path for both).
                for issue in unknown_keys(OmegaConf.create(nested)):
                    self.issues.append(ConfigIssue(issue.key, issue.value, issue.rule + self._moved(parts, i)))
                return
            if i < len(parts) - 1:
                node = node._get_node(part)
        for value in _values(ov):
            try:
                OmegaConf.update(self.schema.copy(), key, value, merge=True)
            except OmegaConfBaseException as exc:
                self.issues.append(ConfigIssue(key, value, _type_rule(node, parts[-1], exc)))

    def _moved(self, parts: list[str], at: int) -> str:
        """Where an unknown key lives instead: a group of its own, or the same name in another group."""
        from hydra.core.object_type import ObjectType

        leaf = parts[at]
        if at == 0:
            return f"; the config groups are {', '.join(self.groups)}"
        if leaf in self.groups:
            options = [o for o in self.repo.get_group_options(leaf, ObjectType.CONFIG) if not o.startswith("base_")]
            return (
                f"; {leaf} is a config group of its own: {leaf}=<option> (options: {', '.join(options)}),"
                f" or {leaf}.<field>=... for one field"
            )
        elsewhere = [f"{g}.{leaf}" for g in self.groups if g != parts[0] and leaf in self.schema[g]]
        return f"; {leaf} is {' and '.join(elsewhere)}" if elsewhere else ""

    # -- composing as Hydra will --------------------------------------------------------------------

    def _compose_every_job(self, parsed: list[Any]) -> None:
        """What no check above names: compose the run as Hydra will, and name the override that makes
        it fail. A sweep: its master config, then every value of every sweep once (with the first
        value of the others), not the whole product, which Hydra composes again before it launches."""
        from hydra.types import RunMode

        lines = [p.input_line for p in parsed]
        if not self.multirun:
            self._compose(lines, RunMode.RUN)
            return
        if not self._compose(lines, RunMode.MULTIRUN):
            return
        try:
            choices = [
                [f"{p.get_key_element()}={v}" for v in p.sweep_string_iterator()]
                if p.is_sweep_override()
                else [p.input_line]
                for p in parsed
            ]
        except Exception:  # noqa: BLE001 - another sweeper's sweep syntax: left to that sweeper
            return
        for i, values in enumerate(choices):
            for value in values[1:] if i else values:
                job = [c[0] for c in choices[:i]] + [value] + [c[0] for c in choices[i + 1 :]]
                if not self._compose(job, RunMode.RUN):
                    return

    def _compose(self, lines: list[str], mode: Any) -> bool:
        try:
            cfg = self.loader.load_configuration(self.config_name, lines, mode)
            self.composed = self.composed or cfg  # the run's config, or the sweep's master config
            return True
        except Exception as exc:  # noqa: BLE001 - any failure of Hydra's is a problem of this line
            culprit = self._culprit(lines, mode)
            key, _, value = (culprit or " ".join(lines)).partition("=")
            self.issues.append(ConfigIssue(key if culprit else COMMAND_LINE, value, _first_lines(exc)))
            return False

    def _culprit(self, lines: list[str], mode: Any) -> str | None:
        for line in lines:
            try:
                self.loader.load_configuration(self.config_name, [line], mode)
            except Exception:  # noqa: BLE001
                return line
        return None

    # -- the folder Hydra will make -----------------------------------------------------------------

    def _check_output_dir(self, lines: list[str]) -> None:
        from hydra.types import RunMode

        key = "hydra.sweep.dir" if self.multirun else "hydra.run.dir"
        try:
            # With other problems, the folder the line's sound overrides name: every problem at once.
            cfg = self.composed or self.loader.load_configuration(
                self.config_name, lines, RunMode.MULTIRUN if self.multirun else RunMode.RUN
            )
            folder = str(OmegaConf.select(cfg, key))
        except Exception:  # noqa: BLE001 - the line's own problems are reported already
            return
        why = unusable_dir(Path(folder))
        if why:
            self.issues.append(ConfigIssue(key, folder, why))


def unusable_dir(path: Path) -> str | None:
    """Why `path` cannot be the run folder (None when it exists as a writable folder or can be made);
    nothing is created."""
    path = Path(os.path.abspath(path))
    if path.exists():
        if not path.is_dir():
            return "exists and is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "is a directory this user cannot write to"
    if path.is_symlink():
        return f"is a broken symbolic link (to {os.readlink(path)})"
    parent = path.parent
    while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable by this user"
    return None


def _loader(config_path: str | None, config_dir: str | None) -> Any:
    """Hydra's config loader with the search path `python -m tonpolicy` gets (-cp and --config-dir honoured)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.errors import SearchPathException

    search_path = create_automatic_config_search_path(None, None, config_path or str(CONF_DIR))
    if config_dir is not None:
        folder = os.path.abspath(config_dir)
        if not os.path.isdir(folder):
            raise SearchPathException(f"--config-dir {folder}: not a directory")
        search_path.prepend("command-line", f"file://{folder}", SearchPathQuery(provider="schema"))
    return ConfigLoaderImpl(config_search_path=search_path)


def _asks_multirun(repo: Any, config_name: str, parsed: list[Any]) -> bool:
    """`hydra.mode=MULTIRUN` on the line or in the primary config: a sweep without -m, as Hydra sees it."""
    for ov in parsed:
        if ov.key_or_group == "hydra.mode":
            return str(ov.value()) == "MULTIRUN"
    primary = repo.load_config(config_name)
    return primary is not None and str(OmegaConf.select(primary.config, "hydra.mode")) == "MULTIRUN"


def _values(ov: Any) -> list[Any]:
    """The values an override sets: one, or each of a sweep's (a glob only matches existing options)."""
    if not ov.is_sweep_override():
        return [ov.value()]
    if ov.is_discrete_sweep() and ov.value_type.name != "GLOB_CHOICE_SWEEP":
        return list(ov.sweep_iterator())
    return []


def _shown(ov: Any) -> Any:
    return ov.value() if not ov.is_sweep_override() else ov.input_line.partition("=")[2]


def _type_rule(parent: Any, leaf: str, exc: Exception) -> str:
    node = parent._get_node(leaf) if isinstance(parent, DictConfig) else None
    if isinstance(node, ListConfig):
        items = _ITEMS.get(node._metadata.element_type)
        return f"must be a list of {items}" if items else _first_lines(exc)
    if isinstance(node, EnumNode):
        expected = f"one of {[m.name for m in node.enum_type]}"
    elif type(node) in _EXPECTED:
        expected = _EXPECTED[type(node)]  # type: ignore[index]
    else:
        return _first_lines(exc)
    return f"must be {expected}" + (" or null" if node is not None and node._is_optional() else "")


def _first_lines(exc: BaseException) -> str:
    """Another program's message on one line, kept to what names the problem (no search path, no
    hints about stack traces); the list after a line ending in ':' is joined with commas."""
    parts: list[str] = []
    listing = False
    for raw in str(exc).splitlines():
        line = raw.strip()
        if line.startswith("Config search path"):
            break
        if not line or line.startswith(("full_key:", "reference_type", "object_type", "Set the env")):
            continue
        if listing:
            parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line
        else:
            parts.append(line)
        listing = listing or line.endswith(":")
    return "; ".join(parts) or type(exc).__name__
