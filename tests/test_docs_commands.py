"""Every shell command in README.md and docs/ uses only flags that exist: each flag is looked up in the
`--help` of the command it is given to (a recipe, a benchmark, `toolkit SUB`, `accelerate launch`,
`torchrun`), so a renamed or removed flag turns this red instead of a user's first run."""

import functools
import re
import shlex

import pytest
from conftest import ACCELERATE, PY, ROOT, TOOLKIT, run

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TORCHRUN_HELP = [PY, "-m", "torch.distributed.run"]


def shell_commands(page):
    """(page, command tokens) for every command line of the page's ```bash blocks, continuations joined."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()  # a trailing comment
            for command in line.split("&&"):
                tokens = [t.strip("[]") for t in shlex.split(command, comments=True)]
                while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):  # VAR=value prefixes
                    tokens.pop(0)
                if tokens:
                    yield tokens


@functools.cache
def help_text(*command) -> str:
    proc = run(list(command) + ["--help"], check=False, timeout=120)
    assert proc.returncode == 0, f"{' '.join(command)} --help exited {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.stdout


def flags(tokens):
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--") and len(t) > 2]


def script_help(script):
    return help_text(PY, ROOT / script) if (ROOT / script).is_file() else None  # my_script.py: the user's


def split_at_script(tokens):
    """(launcher tokens, script, script tokens): the script is the first *.py (or *.sbatch) token."""
    at = next((i for i, t in enumerate(tokens) if t.endswith((".py", ".sbatch"))), len(tokens))
    return tokens[:at], (tokens[at] if at < len(tokens) else None), tokens[at + 1:]


def checks(tokens):
    """(help text, flags that must appear in it) for one command."""
    program = tokens[0]
    if program in ("python", "python3"):
        head, script, rest = split_at_script(tokens[1:])
        if script and script_help(script):
            yield script_help(script), flags(rest)
    elif program == "accelerate" and tokens[1:2] == ["launch"]:
        head, script, rest = split_at_script(tokens[2:])
        yield help_text(*ACCELERATE), flags(head)
        if script and script_help(script):
            yield script_help(script), flags(rest)
    elif program == "torchrun":
        head, script, rest = split_at_script(tokens[1:])
        yield help_text(*TORCHRUN_HELP), flags(head)
        if script and script_help(script):
            yield script_help(script), flags(rest)
    elif program == "toolkit":
        sub, rest = [tokens[1]], tokens[2:]
        nested = rest and not rest[0].startswith("-") and rf"{{[\w,]*\b{re.escape(rest[0])}\b"  # argparse's {a,b}
        if nested and re.search(nested, help_text(*TOOLKIT, *sub)):
            sub, rest = sub + rest[:1], rest[1:]  # toolkit checkpoint consolidate: its own --help
        if "--" in rest:  # toolkit parity ... -- script.py args
            cut = rest.index("--")
            yield help_text(*TOOLKIT, *sub), flags(rest[:cut])
            _, script, script_args = split_at_script(rest[cut + 1:])
        else:
            head, script, script_args = split_at_script(rest)
            yield help_text(*TOOLKIT, *sub), flags(head)
        if script and script_help(script):
            yield script_help(script), flags(script_args)
    elif program == "sbatch":  # sbatch's own flags are SLURM's; the rest go to the recipe
        _, script, rest = split_at_script(tokens[1:])
        yield help_text(PY, ROOT / "recipes" / "cifar.py"), flags(rest)


COMMANDS = [(page.relative_to(ROOT), tokens) for page in PAGES for tokens in shell_commands(page)]


def test_the_pages_hold_the_commands_users_run():
    programs = {tokens[0] for _, tokens in COMMANDS}
    assert {"python", "accelerate", "torchrun", "toolkit", "pip"} <= programs, programs
    assert len(COMMANDS) >= 30, len(COMMANDS)


def test_every_flag_in_the_docs_exists_in_the_help_of_its_command():
    missing = []
    for page, tokens in COMMANDS:
        for text, wanted in checks(tokens):
            for flag in wanted:
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                    missing.append(f"{page}: {flag} in `{' '.join(tokens)}`")
    assert not missing, "flags the commands' --help does not know:\n" + "\n".join(missing)


def test_no_page_shows_a_launcher_that_prints_a_warning_we_cannot_filter():
    """torch's legacy `python -m torch.distributed.launch` prints a FutureWarning from its own process (not
    ours, so not filterable at the source): the pages show torchrun instead and say why (docs/engines.md)."""
    shown = [" ".join(tokens) for page in PAGES for tokens in shell_commands(page)]
    assert not [command for command in shown if "torch.distributed.launch" in command], shown
    assert "FutureWarning" in (ROOT / "docs" / "engines.md").read_text()
