"""Settings from a TOML file: `kvpool master --config FILE`, `kvpool node --config FILE`.

A file holds a table per command; its keys are the command's options, as spelt on the command
line without the leading dashes (or with underscores):

    [master]
    host = "0.0.0.0"
    lease-ttl-ms = 10000

    [node]
    master = "master-host:50051"
    memory = "64GiB"
    disk-dir = "/nvme/kvpool"
    disk-size = "1TiB"

A command reads its own table. The command line wins, then the environment (`KVPOOL_*`), then
the file, then the defaults (click's `default_map`, which the eager `--config` option fills
before any other option is read). A key the command does not have, a table no command reads,
a key outside a table, or a file that is not TOML is a usage error naming it: a misspelt
setting never passes silently.
"""

from __future__ import annotations

import contextvars
import datetime
import os
import re
import tomllib
from pathlib import Path
from typing import Optional

import typer

# The commands that take --config: the long-running ones, whose settings live in a service's files.
COMMANDS = ("master", "node")

# The command whose settings a file gave (set by load_settings), for `flags_from_file`.
_configured: contextvars.ContextVar[tuple[typer.Context, Path] | None] = contextvars.ContextVar(
    "kvpool_configured", default=None
)


def load_settings(ctx: typer.Context, param: typer.CallbackParam, path: Optional[Path]) -> Optional[Path]:
    """The `--config` option's callback: the file's table for this command becomes the
    defaults of the command's other options.

    Raises:
        typer.BadParameter: the file cannot be read or is not TOML; it holds a setting the
            command does not have (or twice), a value of a kind or range the option refuses,
            a table no command reads, a key outside a table, or no table for this command.
    """
    if path is None or ctx.resilient_parsing:
        return path
    try:
        with open(path, "rb") as file:
            tables = tomllib.load(file)
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise typer.BadParameter(f"{path} is not TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8
        raise typer.BadParameter(f"{path} is not TOML: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    tables_named = ", ".join(f"[{command}]" for command in COMMANDS)
    for name, value in tables.items():
        if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            raise typer.BadParameter(f"{path}: [[{name}]] is an array of tables (the tables are {tables_named})")
        if not isinstance(value, dict):
            raise typer.BadParameter(f"{path}: {name!r} is outside a table (settings go under {tables_named})")
        if name not in COMMANDS:
            raise typer.BadParameter(f"{path}: no command reads [{name}] (the tables are {tables_named})")
    command = ctx.info_name or ""
    if command not in tables:  # it ran on defaults without a word (walk-through helper-155)
        raise typer.BadParameter(f"{path} has no [{command}] table: nothing in it is for `kvpool {command}`")
    options = {option.name: option for option in ctx.command.params if option.name != param.name}
    defaults: dict[str, object] = {}
    for key, value in tables[command].items():
        option = options.get(key.replace("-", "_"))
        if option is None:
            raise typer.BadParameter(f"{path}: [{command}] has no setting {key!r} (`kvpool {command} --help`)")
        if option.name in defaults:
            raise typer.BadParameter(f"{path}: [{command}] sets {key!r} twice")
        where = f"{path}: [{command}] {key} = {value!r}"
        _check_kind(where, option, value)
        try:  # here, so that the error names the file, not an option the command line never gave
            option.process_value(ctx, value)
        except typer.BadParameter as exc:
            raise typer.BadParameter(f"{where}: {exc.message}") from None
        defaults[option.name] = value
    # The token in the environment (KVPOOL_TOKEN) is read by the command itself, after its token
    # file: a token file from the settings file gives way to it, as the environment wins.
    if os.environ.get("KVPOOL_TOKEN"):
        defaults.pop("token_file", None)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    _configured.set((ctx, path))
    return path


def forget_settings() -> None:
    """A new command line begins (the group's callback): what a settings file gave an earlier
    one run in this process (a test's CLI runner) is not its."""
    _configured.set(None)


def flags_from_file(message: str) -> str:
    """Where the flags a refusal names were set, when the settings file set them: " (--disk-size:
    from [node] in FILE)", or "". An operator who typed no `--disk-size` is otherwise sent
    looking at a command line that does not hold it."""
    configured = _configured.get()
    if configured is None:
        return ""
    ctx, path = configured
    flags = [flag for flag in dict.fromkeys(re.findall(r"--[a-z][a-z0-9-]*", message)) if _is_from_file(ctx, flag)]
    return f" ({', '.join(flags)}: from [{ctx.info_name}] in {path})" if flags else ""


def _is_from_file(ctx: typer.Context, flag: str) -> bool:
    source = ctx.get_parameter_source(flag[2:].replace("-", "_"))
    return source is not None and source.name == "DEFAULT_MAP"  # click's enum; typer may vendor click


def _check_kind(where: str, option: object, value: object) -> None:
    """Refuse what an option would read as something else: no option takes a list, a table or
    a date (they would become their text), a yes/no only a flag (`port = true` would be port
    1), and an empty text means the working directory for a path (remove the line instead)."""
    if isinstance(value, (list, dict, datetime.date, datetime.time)):
        raise typer.BadParameter(f"{where}: give a single value")
    if isinstance(value, bool) and not getattr(option, "is_flag", False):
        raise typer.BadParameter(f"{where}: not a yes/no setting")
    if value == "":
        raise typer.BadParameter(f"{where}: empty (remove the line to leave it unset)")
