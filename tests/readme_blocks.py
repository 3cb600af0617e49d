"""The README's bash blocks and lines, for the tests that run them as written.

A test runs a README line through :func:`readme_line` or a whole block through
:func:`readme_block`, with a literal first argument: ``tests/test_readme_examples.py`` reads
those calls to prove that every line the README shows is run by some test. Three liberties
are allowed, each visible in the test: a placeholder (``<bundle>``, ``<launcher pid>``, a
cluster's address) is filled in; an option that only says where output goes (``--json``,
``--trace FILE``, ``--junit FILE``) may be added; and a campaign line over more cells than the
suite can afford is narrowed with :func:`narrowed` to a subset of its own cells, every other
option as written.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bash_env() -> dict[str, str]:
    """The environment README lines run in: this interpreter's commands first, no colour."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "NO_COLOR": "1"}


def run_line(line: str, cwd: Path, env: dict[str, str] | None = None,
             timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """``line`` run by bash in ``cwd`` (``env`` defaults to :func:`bash_env`), its output
    captured; the exit status is the caller's to judge."""
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env or bash_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def port_free(port: int) -> bool:
    """Nothing listens on ``port`` of 127.0.0.1 (a README line names its own ports)."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def readme_blocks() -> list[list[str]]:
    """Every bash block of the README as its lines, continuation lines joined, comment-only
    lines dropped."""
    blocks = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        lines: list[str] = []
        pending = ""
        for raw in block.strip().splitlines():
            if raw.rstrip().endswith("\\"):  # a continuation: joined with the next line
                pending += raw.rstrip()[:-1].strip() + " "
                continue
            raw, pending = pending + raw.strip(), ""
            if raw and not raw.startswith("#"):
                lines.append(raw)
        blocks.append(lines)
    return blocks


def readme_block(first: str) -> list[str]:
    """The lines of the README's bash block that starts with ``first``."""
    for lines in readme_blocks():
        if lines and lines[0].startswith(first):
            return lines
    raise AssertionError(f"no README block starting {first!r}")


def readme_line(prefix: str) -> str:
    """The one README bash line that is ``prefix`` or, failing that, starts with it, without
    its trailing comment."""
    every = [ln for lines in readme_blocks() for ln in lines]
    found = [ln for ln in every if command(ln) == prefix] or \
        [ln for ln in every if ln.startswith(prefix)]
    assert len(found) == 1, f"{len(found)} README lines start with {prefix!r}: {found}"
    return command(found[0])


def command(line: str) -> str:
    """A README line without its trailing comment."""
    return line.split("  #")[0].strip()


def narrowed(line: str, only: str, cwd: Path = ROOT) -> str:
    """A campaign line run on a subset of its cells: ``--only GLOB`` added, or put in place of
    the line's own ``--only``; every cell GLOB selects must be one the line selects (``cwd``:
    where the line's spec file is)."""
    from cli import _seeds
    from faults.campaign.cells import select
    from faults.campaign.plan import load_campaign

    args = shlex.split(line)
    assert args[:2] == ["hicache", "campaign"], line
    spec_arg = args[2] if len(args) > 2 and not args[2].startswith("-") else None
    spec = load_campaign(cwd / spec_arg if spec_arg else None)
    seeds = _seeds(args[args.index("--seeds") + 1]) if "--seeds" in args else None
    own = args[args.index("--only") + 1] if "--only" in args else None
    mine = {c.id for c in select(spec, only, seeds)}
    assert mine, (only, line)
    assert mine <= {c.id for c in select(spec, own, seeds)}, (only, line)
    if own is not None:
        args[args.index("--only") + 1] = only
    else:
        redirect = args.index(">") if ">" in args else len(args)
        args[redirect:redirect] = ["--only", only]
    return shlex.join(args).replace("'>'", ">")
