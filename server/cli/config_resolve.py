"""Where each setting of an `ember` command comes from: CLI flag > EMBER_* environment variable > --config TOML
file > built-in default.

argparse alone cannot tell a flag given on the command line from its default, so the command line is parsed a
second time with every default suppressed: what is left was typed. Env values and TOML values go through the
same argparse action (its `type` and `choices`) as a typed flag, so `EMBER_PORT=abc` fails like `--port abc`.

The environment variable of a setting is always `EMBER_` + its dest in upper case (`--max-running-requests`
-> EMBER_MAX_RUNNING_REQUESTS); TOML keys are the flag names without the dashes in front, with `-` or `_`.
"""
from __future__ import annotations

import argparse
import json
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

CONFIG_ENV = "EMBER_CONFIG"
SOURCES = ("flag", "env", "config", "default")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
_SECRET_DESTS = frozenset({"api_key"})


class ConfigError(ValueError):
    """A bad config file, config key, or environment value; the message names the culprit."""


@dataclass(frozen=True)
class Setting:
    dest: str
    flag: str  # "--max-running-requests"
    value: Any
    source: str  # one of SOURCES
    origin: str  # what set it: the flag, the env var name, the config file path; "" for a default


def env_name(dest: str) -> str:
    return "EMBER_" + dest.upper()


def setting_dests(add_args: Any) -> list[str]:
    """The dests that `add_args(parser)` defines, in definition order (a throwaway parser parses nothing)."""
    scratch = argparse.ArgumentParser(add_help=False)
    add_args(scratch)
    return list(vars(scratch.parse_args([])))


def load_config_file(path: str) -> dict[str, Any]:
    """A flat TOML table of settings, keys normalised to dests (`max-running-requests` -> max_running_requests)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "sampling" and isinstance(value, dict):  # the model's sampling defaults, overridden
            out["override_generation_config"] = json.dumps(value)
            continue
        if isinstance(value, dict):
            raise ConfigError(f"config file {path}: [{key}] tables are not supported; write settings as top-level keys")
        out[key.replace("-", "_")] = value
    return out


def _option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    # argparse has no public way to enumerate a parser's actions; `_actions` has been stable since Python 2.7.
    return {a.dest: a for a in parser._actions if a.option_strings}


@contextmanager
def _defaults_suppressed(parser: argparse.ArgumentParser) -> Iterator[None]:
    actions = list(_option_actions(parser).values())
    saved = [a.default for a in actions]
    for a in actions:
        a.default = argparse.SUPPRESS
    try:
        yield
    finally:
        for a, d in zip(actions, saved, strict=True):
            a.default = d


def explicit_values(parser: argparse.ArgumentParser, command_parser: argparse.ArgumentParser,
                    argv: list[str]) -> dict[str, Any]:
    """The settings typed on the command line `argv` (already known to parse) of the subcommand `command_parser`."""
    with _defaults_suppressed(command_parser):
        return vars(parser.parse_args(argv))


def _convert_text(action: argparse.Action, text: str, where: str) -> Any:
    """An env string through the action's own conversion, as if it had been typed after the flag."""
    if action.nargs == 0:  # a boolean flag
        lowered = text.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ConfigError(f"{where}: expected a boolean (1/0, true/false), got {text!r}")
    try:
        value = action.type(text) if callable(action.type) else text
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"{where}: invalid value {text!r} ({exc})") from None
    _check_choices(action, value, where)
    return value


def _convert_toml(action: argparse.Action, value: Any, where: str) -> Any:
    if action.nargs == 0:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if isinstance(value, bool) or isinstance(value, (dict, list)) and action.type in (int, float, None):
        raise ConfigError(f"{where}: expected a {getattr(action.type, '__name__', 'string')}, got {value!r}")
    if isinstance(value, list):  # e.g. decode-buckets = [1, 2, 4]: the flag's own comma-separated form
        return _convert_text(action, ",".join(str(v) for v in value), where)
    if action.type is float and isinstance(value, (int, float)):
        return float(value)
    if action.type is int and isinstance(value, float):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if action.type in (None, str) and not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return _convert_text(action, str(value), where)


def _default_value(action: argparse.Action) -> Any:
    # argparse runs a string default through `type` (e.g. "1,2,4" for the buckets); so do we.
    if isinstance(action.default, str) and callable(action.type):
        return action.type(action.default)
    return action.default


def _check_choices(action: argparse.Action, value: Any, where: str) -> None:
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(str(c) for c in action.choices)
        raise ConfigError(f"{where}: {value!r} is not one of {choices}")


def resolve(command_parser: argparse.ArgumentParser, explicit: Mapping[str, Any], dests: list[str],
            config: Mapping[str, Any], config_path: str | None, environ: Mapping[str, str]) -> list[Setting]:
    """One Setting per dest in `dests` (those the subcommand defines; others are skipped), highest source wins.

    `config` is load_config_file's result; a key that is no setting of any command is an error, a key that is
    a setting of another command (e.g. `port` for `ember compile`) is ignored.
    """
    actions = _option_actions(command_parser)
    unknown = sorted(set(config) - set(dests))
    if unknown:
        known = ", ".join(d.replace("_", "-") for d in dests)
        raise ConfigError(f"config file {config_path}: unknown setting(s) {', '.join(unknown)}; known: {known}")
    settings: list[Setting] = []
    for dest in dests:
        action = actions.get(dest)
        if action is None:
            continue
        flag = action.option_strings[0]  # "--disable-compile", not its "--no-disable-compile" twin
        name = env_name(dest)
        if dest in explicit:
            settings.append(Setting(dest, flag, explicit[dest], "flag", flag))
        elif name in environ:
            value = _convert_text(action, environ[name], f"environment variable {name}")
            settings.append(Setting(dest, flag, value, "env", name))
        elif dest in config:
            value = _convert_toml(action, config[dest], f"config file {config_path}: {dest.replace('_', '-')}")
            settings.append(Setting(dest, flag, value, "config", str(config_path)))
        else:
            # With the env var unset, the parser's default is the built-in one even where add_*_args read env.
            settings.append(Setting(dest, flag, _default_value(action), "default", ""))
    return settings


def config_path_of(explicit: Mapping[str, Any], environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The config file to load and what named it: (path, "flag" | "env" | "default")."""
    if explicit.get("config"):
        return str(explicit["config"]), "flag"
    if environ.get(CONFIG_ENV):
        return environ[CONFIG_ENV], "env"
    return None, "default"


def apply(args: argparse.Namespace, settings: list[Setting]) -> None:
    for s in settings:
        setattr(args, s.dest, s.value)


def _show(s: Setting) -> str:
    if s.value is None:
        return "(unset)"
    if s.dest in _SECRET_DESTS:
        return "(set, hidden)"
    if isinstance(s.value, tuple):
        return ",".join(str(v) for v in s.value)
    return str(s.value)


def format_settings(settings: list[Setting], config_path: str | None, config_source: str) -> str:
    """The `--print-config` table: flag, resolved value, where it came from."""
    where = f"{config_path} (from {'--config' if config_source == 'flag' else CONFIG_ENV})" if config_path else "none"
    lines = [f"config file: {where}", "precedence: flag > env > config > default", ""]
    width = max(len(s.flag) for s in settings)
    vwidth = max(len(_show(s)) for s in settings)
    for s in settings:
        origin = f" ({s.origin})" if s.source in ("env", "config") else ""
        lines.append(f"{s.flag:<{width}}  {_show(s):<{vwidth}}  {s.source}{origin}")
    return "\n".join(lines)

