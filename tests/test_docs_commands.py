"""The front door: what README.md and docs/ tell an operator to type is what the `kvpool`
command takes, and what `kvpool <cmd> --help` lists is documented.

How: the docs' fenced `kvpool ...` lines and inline `kvpool ...` spans are read from the
Markdown files; each names a command that exists and only options of that command. The lines an
operator types as they are (README's deployment, docs/operations.md, docs/ha.md, docs/tiers.md:
no placeholder such as HOST:PORT or `...`) are parsed whole by click, values included, without
running the command; the settings file that docs/operations.md shows is read by `kvpool master`
and `kvpool node` as they read a `--config` file. Every option and environment variable of
every command is named somewhere in README.md or docs/; every command and option has help, and
`kvpool --help` lists each command on one uncut line. On a real cluster: a key holding ":ok:"
is printed as it is (rich read it as an emoji code). Bounded: a few seconds.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from kvpool.cli.main import app
from tests.test_cluster import kvpool_cli

REPOSITORY = Path(__file__).resolve().parent.parent
DOCS = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
# The pages an operator follows command by command: their commands must parse whole.
RUNBOOKS = {"README.md", "operations.md", "ha.md", "tiers.md"}
# What marks a command as a template rather than one to type: "...", "[--option]", or a word in
# capitals (HOST:PORT, TRACE, KEY, FILE, PATH, N).
PLACEHOLDER = re.compile(r"\.\.\.|\[|(?<![\w/.-])[A-Z][A-Z_]*(?::[A-Z]+)?(?![\w/.-])")

CLI = typer.main.get_command(app)


def _fenced_lines(text: str) -> list[str]:
    """The `kvpool` lines of a page's fenced blocks, continuation lines joined, comments cut,
    a command substitution (`$(hostname -I ...)`) replaced by the address it prints."""
    lines = []
    for block in re.findall(r"^```\w*\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\$\([^)]*\)", "10.0.0.2", line.split(" #")[0]).strip()
            line = line.split("&&")[-1].strip()  # `pip install -e . && kvpool demo`
            if line.startswith("kvpool "):
                lines.append(line)
    return lines


def _inline_commands(text: str) -> list[str]:
    return re.findall(r"`(kvpool [^`]*)`", text)


def _documented_commands() -> list[tuple[str, str, bool]]:
    """(page, command line, whether it is typed as it is) for every command the docs show."""
    found = []
    for page in DOCS:
        text = page.read_text()
        for line in _fenced_lines(text):
            found.append((page.name, line, page.name in RUNBOOKS and not PLACEHOLDER.search(line)))
        for line in _inline_commands(text):
            found.append((page.name, line, False))
    return found


def _is_option(param) -> bool:
    return param.param_type_name == "option"  # not isinstance: typer may vendor click


def _options(command) -> set[str]:
    names = {"--help"}
    for param in filter(_is_option, command.params):
        names.update(param.opts, param.secondary_opts)
    return names


COMMANDS = _documented_commands()


def test_the_docs_show_the_commands_an_operator_types() -> None:
    # The extraction itself: were it to find nothing, every test below would pass.
    typed = {line.split()[1] for _, line, is_typed in COMMANDS if is_typed}
    assert {"master", "node", "bench", "stat", "demo"} <= typed, typed


@pytest.mark.parametrize(("page", "line", "is_typed"), COMMANDS, ids=[f"{p}: {c}" for p, c, _ in COMMANDS])
def test_each_documented_command_exists_with_the_options_it_names(page: str, line: str, is_typed: bool) -> None:
    words = shlex.split(line.replace("[", " ").replace("]", " "))[1:]
    if not words or words[0].startswith("-"):  # `kvpool --version`
        assert set(words) <= _options(CLI), (page, line)
        return
    command = CLI.commands.get(words[0])
    assert command is not None, f"{page}: `{line}`: kvpool has no command {words[0]!r}"
    named = {word.split("=")[0] for word in words[1:] if re.match(r"-{1,2}[a-z]", word)}
    assert named <= _options(command), f"{page}: `{line}`: no such option {sorted(named - _options(command))}"
    if is_typed:
        # Parsed as click parses it, values included (a port that is not a number, a choice
        # that is not one), without running the command.
        command.make_context(words[0], words[1:])


def test_the_settings_file_of_the_operations_page_is_read_by_both_commands(tmp_path: Path) -> None:
    text = (REPOSITORY / "docs" / "operations.md").read_text()
    (settings,) = re.findall(r"^```toml\n(.*?)^```", text, re.S | re.M)
    path = tmp_path / "kvpool.toml"
    path.write_text(settings)
    for name in ("master", "node"):
        context = CLI.commands[name].make_context(name, ["--config", str(path)])
        assert context.default_map, (name, settings)  # each table was taken, key by key


def test_every_option_and_variable_of_every_command_is_documented() -> None:
    text = "\n".join(page.read_text() for page in DOCS)
    missing = []
    for name, command in CLI.commands.items():
        for param in filter(_is_option, command.params):
            names = [option for option in param.opts if option.startswith("--")]
            names += [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
            missing += [f"kvpool {name} {n}" for n in names if not re.search(re.escape(n) + r"(?![\w-])", text)]
    assert not missing, f"named in --help but in no page of README.md or docs/: {missing}"


def test_keys_holding_an_emoji_code_are_printed_as_they_are(make_cluster) -> None:
    # rich, printing the command's lines, turned ":ok:" into an emoji: `stored layer🆗0`.
    cluster = make_cluster(1, "4MiB")
    master = ("--master", cluster.master_endpoint)
    put = kvpool_cli("put", "layer:ok:0", *master, stdin=b"v")
    assert (put.returncode, put.stderr.decode()) == (0, "stored layer:ok:0 (1 bytes)\n")
    stat = kvpool_cli("stat", "layer:ok:0", *master)
    assert stat.returncode == 0 and "layer:ok:0" in stat.stdout.decode(), stat.stdout.decode()
    missed = kvpool_cli("get", "layer:fire:1", *master)
    assert (missed.returncode, missed.stderr.decode()) == (3, "error: layer:fire:1: not found\n")


def test_every_command_and_option_says_what_it_is() -> None:
    from typer.testing import CliRunner

    listed = CliRunner().invoke(app, ["--help"], terminal_width=80).output
    for name, command in CLI.commands.items():
        assert command.help, f"kvpool {name} --help says nothing of the command"
        # The list of commands cut the longer first sentences ("a DRAM segment (and a disk...").
        (line,) = [line for line in listed.splitlines() if line.startswith(f"  {name} ")]
        assert not line.endswith("..."), line
        for param in filter(_is_option, command.params):
            assert param.help, f"kvpool {name} {param.opts[0]} has no help"
