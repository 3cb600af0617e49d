"""The README's bash blocks, for the tests that run its lines as written."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bash_env() -> dict[str, str]:
    """The environment README lines run in: this interpreter's commands first, no colour."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "NO_COLOR": "1"}


def readme_block(first: str) -> list[str]:
    """The lines of the README's bash block that starts with ``first``."""
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        lines = block.strip().splitlines()
        if lines and lines[0].startswith(first):
            return lines
    raise AssertionError(f"no README block starting {first!r}")


def command(line: str) -> str:
    """A README line without its trailing comment."""
    return line.split("  #")[0].strip()
