"""Write docs/cli.md, the command-line reference, from the argparse parsers themselves.

    .venv/bin/python scripts/cli_reference.py            # rewrite docs/cli.md
    .venv/bin/python scripts/cli_reference.py --check    # exit 1 when docs/cli.md is stale

Run with no GPUPLANE_* variables set: `env_flag` defaults follow the environment of the process that
builds the parser. tests/test_docs.py fails when a command or flag is missing from the page.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"
_ENV = re.compile(r"\s*\(env (?P<env>[A-Z0-9_]+), default (?P<default>.*)\)$", re.DOTALL)


def parsers() -> list[tuple[str, Callable[[], argparse.ArgumentParser], str]]:
    """(program, parser factory, what it is), in the order of the page."""
    from cache_service.__main__ import _parser as cache_parser
    from gpu_worker.__main__ import build_parser as worker_parser
    from gpu_worker.edge.user_cli import build_parser as user_parser
    from services.governor.__main__ import _parser as governor_parser

    def demo_parser() -> argparse.ArgumentParser:
        from gpu_worker.stack import demo

        return demo.build_parser()

    return [
        ("gpuplane", user_parser, "the users' CLI against a running stack (`gpu_worker/edge/user_cli.py`)"),
        ("python -m gpu_worker", worker_parser, "the GPU worker's server (`gpu_worker/__main__.py`)"),
        ("python -m cache_service", cache_parser, "the kernel cache's server and operator CLI"),
        ("python -m services.governor", governor_parser, "the memory governor's server and CLI"),
        ("python -m gpu_worker.stack.demo", demo_parser, "`make run` and `make serve`"),
    ]


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS]


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _row(action: argparse.Action) -> str:
    name = "`" + "`, `".join(action.option_strings) + "`"
    if action.metavar or (action.nargs != 0 and not isinstance(action, argparse._StoreConstAction)):
        if action.choices and not action.metavar:
            name += " {" + ",".join(map(str, action.choices)) + "}"
        elif action.nargs != 0:
            name += f" {action.metavar or action.dest.upper()}"
    help_text = action.help or ""
    env, default = "", ""
    match = _ENV.search(help_text)
    if match:
        help_text, env, default = help_text[:match.start()], f"`{match['env']}`", match["default"]
    elif action.nargs == 0:
        default = ""
    elif action.default not in (None, "", [], argparse.SUPPRESS):
        default = repr(action.default)
    if action.required:
        default = "required"
    return f"| {name} | {_cell(help_text)} | {env} | {_cell(default)} |"


def _table(parser: argparse.ArgumentParser) -> list[str]:
    rows = [_row(a) for a in flags(parser)]
    positionals = [a for a in parser._actions if not a.option_strings
                   and not isinstance(a, argparse._SubParsersAction)]
    rows = [f"| `{a.dest.upper()}` (argument) | {_cell(a.help or '')} | | required |"
            for a in positionals] + rows
    if not rows:
        return ["No flags.", ""]
    return ["| flag | meaning | environment | default |", "|---|---|---|---|", *rows, ""]


def render() -> str:
    out = [
        "# Command-line reference",
        "",
        "Every command and flag of every gpuplane CLI, written from the parsers by",
        "`scripts/cli_reference.py` (tests/test_docs.py fails when one is missing here). A flag",
        "beats its environment variable, which beats the default. Flags are never abbreviated.",
        "",
        "Exit codes, shared by every CLI (`services/common/cli.py`): 0 ok, 1 not found (a lookup",
        "miss, a NOT_FOUND status), 2 usage (a flag or combination that cannot work), 3 the call",
        "failed (any other status), 4 no server answered (UNAVAILABLE; the message names the flag",
        "and variable that point the command elsewhere). Failures go to stderr as",
        "`PROG COMMAND: error: MESSAGE`.",
        "",
    ]
    for prog, factory, what in parsers():
        parser = factory()
        out += [f"## {prog}", "", f"{what[0].upper()}{what[1:]}.", ""]
        subs = commands(parser)
        if flags(parser) or not subs:
            if subs:
                out += ["Flags before the command:", ""]
            out += _table(parser)
        for name, sub in subs.items():
            out += [f"### {prog} {name}", "", _cell(sub.description or ""), "", *_table(sub)]
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/cli.md is stale")
    args = ap.parse_args()
    stale = [k for k in os.environ if k.startswith("GPUPLANE_")]
    if stale:
        print(f"unset {' '.join(stale)} first: they change the defaults shown", file=sys.stderr)
        return 2
    text = render()
    if args.check:
        return 0 if PAGE.read_text() == text else 1
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
