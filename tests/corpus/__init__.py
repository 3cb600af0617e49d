"""The corpus of real crash reports: loading, the doctor's answer, page wrappers, perturbation.

Each case is ``cases/<id>.txt`` (a verbatim excerpt of what machines printed in a public issue
thread, trimmed only with ``[...]``) and ``cases/<id>.yaml`` (its URL, the accepted answers,
``[none]`` for a look-alike that fits no signature, and the reason in a line). See README.md.

Used by ``tests/doctor/test_corpus.py`` and ``bench/triage_accuracy.py``.
"""

from __future__ import annotations

import html
import io
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from doctor.diagnose import diagnose
from doctor.report.model import Diagnosis

CASES = Path(__file__).parent / "cases"
FIRST_LOOK = Path(__file__).parent / "first_look.yaml"
NONE = "none"


@dataclass(frozen=True)
class Case:
    id: str
    text: bytes
    url: str
    source: str
    label: tuple[str, ...]
    reason: str
    category: str
    formats: tuple[str, ...]
    round: str = ""
    """The round it came in (``""``: rounds 1-5, before rounds were recorded per case)."""
    decides: bool = True
    """False when its labeller noted that the excerpt lacks the deciding line (the thread
    establishes the label; the excerpt alone cannot show it)."""

    @property
    def positive(self) -> bool:
        return NONE not in self.label


def load_cases(root: Path = CASES) -> list[Case]:
    out = []
    for meta_path in sorted(root.glob("*.yaml")):
        meta = yaml.safe_load(meta_path.read_text(encoding="utf-8"))
        out.append(Case(id=meta_path.stem, text=meta_path.with_suffix(".txt").read_bytes(),
                        url=meta["url"], source=meta["source"], label=tuple(meta["label"]),
                        reason=meta["reason"], category=meta.get("category", ""),
                        formats=tuple(meta.get("formats", [])),
                        round=str(meta.get("round", "")),
                        decides=bool(meta.get("excerpt_decides", True))))
    return out


def answer(d: Diagnosis) -> tuple[str, float]:
    """The doctor's top-1 answer: the first verdict's signature, or ``none`` (with the closest
    candidate's score as its confidence of *not* knowing)."""
    if d.verdicts:
        return d.verdicts[0].signature, d.verdicts[0].confidence
    return NONE, d.near_misses[0].score if d.near_misses else 0.0


def diagnose_bytes(name: str, data: bytes) -> Diagnosis:
    return diagnose(streams=[(name, io.BytesIO(data))])


def as_markdown(case: Case) -> bytes:
    """The excerpt inside an issue page of our own: headings, prose, a fenced block in a
    ``<details>`` section, CRLF line ends (what a browser's "save as text" gives)."""
    body = case.text.decode("utf-8", errors="replace")
    page = ("### Describe the bug\r\n\r\nThe server died overnight; logs below.\r\n\r\n"
            "<details>\r\n<summary>server log</summary>\r\n\r\n```text\r\n"
            + body.replace("\n", "\r\n") + "\r\n```\r\n\r\n</details>\r\n\r\n"
            "### Environment\r\n\r\nPython 3.10, 8 GPUs.\r\n")
    return page.encode("utf-8")


def as_html(case: Case) -> bytes:
    """The excerpt inside an HTML page of our own (entities escaped, markup around it)."""
    body = html.escape(case.text.decode("utf-8", errors="replace"))
    page = ("<!DOCTYPE html><html><head><title>[Bug] server crash</title>"
            "<style>pre{color:red}</style></head><body><div class=\"comment\">"
            "<p>The server died overnight. Logs:</p><details><summary>log</summary>"
            f"<pre><code>{body}</code></pre></details><p>Any idea?</p></div></body></html>")
    return page.encode("utf-8")


def as_blockquote(case: Case) -> bytes:
    """The excerpt quoted in a Markdown comment: ``> `` before every line."""
    body = case.text.decode("utf-8", errors="replace")
    return "\n".join(f"> {line}" if line else ">" for line in body.split("\n")).encode("utf-8")


def as_container_log(case: Case) -> bytes:
    """The excerpt as a container runtime stores it (CRI: timestamp, stream, full-line tag)."""
    body = case.text.decode("utf-8", errors="replace")
    return "\n".join(f"2026-06-24T17:38:03.{i:09d}+02:00 stderr F {line}"
                     for i, line in enumerate(body.split("\n"))).encode("utf-8")


# --- perturbation: the same failure on another machine, other ranks, another version ------

_TS = re.compile(r"\b(20\d\d)-(\d\d)-(\d\d)([ T_])(\d\d):(\d\d):(\d\d)")
_GLOG_TS = re.compile(r"\b([IWEF])(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+)")
_SHORT_TS = re.compile(r"\b(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\b")
_LINE = re.compile(r"(line |\.py:|\.py\", line |\.(?:cc|cpp|cu|h|hpp|c):)(\d{1,6})\b")
_ADDR = re.compile(r"\b0x[0-9a-fA-F]{6,16}\b")
_PID = re.compile(r"\b(pid[=:] ?|PID |LWP )(\d{2,9})\b")
_IP = re.compile(r"\b(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})\b")
_PREFIX = re.compile(r"(?:/[\w.@+-]+)+?/(?=(?:sglang|vllm|torch|lmcache|mooncake|nixl|deepspeed|"
                     r"lightning|lightning_fabric|transformers|flashinfer|sgl_kernel)/)")
_HOME = re.compile(r"/home/[\w.-]+/")
_TP = re.compile(r"\b(TP|tp_rank=|tp_rank: )(\d{1,3})\b")
_RANK = re.compile(r"(\[rank|\[default|\[Rank |Rank |rank=|rank )(\d{1,4})\b")


def perturb(text: str, seed: int) -> str:
    """The same report as another deployment would print it: other install paths and home
    directories, other timestamps, line numbers shifted (another version), other addresses,
    pids and IPs, and the ranks renumbered consistently (pipeline stage numbers keep their
    meaning: PP0 stays the first stage)."""
    rng = random.Random(seed)
    days, hours = rng.randint(1, 300), rng.randint(1, 20)
    shift = rng.choice([-7, -3, 2, 5, 11, 40])
    prefix = rng.choice(["/usr/local/lib/python3.12/dist-packages/",
                         "/opt/conda/envs/serve/lib/python3.10/site-packages/",
                         "/srv/deploy/.venv/lib/python3.11/site-packages/",
                         "/workspace/src/"])
    rank_map: dict[tuple[str, int], int] = {}

    def new_rank(space: str, n: int) -> int:
        """A bijection per namespace (TP ranks, global ranks), drawn as numbers come."""
        if (space, n) not in rank_map:
            used = {v for (s, _), v in rank_map.items() if s == space}
            rank_map[(space, n)] = rng.choice([i for i in range(max(16, n + 8))
                                               if i not in used])
        return rank_map[(space, n)]

    def ts(m: re.Match[str]) -> str:
        y, mo, d = int(m[1]), int(m[2]), int(m[3])
        d2 = (d - 1 + days) % 28 + 1
        mo2 = (mo - 1 + days // 28) % 12 + 1
        return f"{y}-{mo2:02d}-{d2:02d}{m[4]}{(int(m[5]) + hours) % 24:02d}:{m[6]}:{m[7]}"

    text = _TS.sub(ts, text)
    text = _GLOG_TS.sub(lambda m: f"{m[1]}{(int(m[2]) % 12) + 1:02d}{m[3]} "
                                  f"{(int(m[4]) + hours) % 24:02d}:{m[5]}:{m[6]}."
                                  f"{str(rng.getrandbits(40))[:len(m[7])].zfill(len(m[7]))}",
                        text)
    text = _SHORT_TS.sub(lambda m: f"{(int(m[1]) % 12) + 1:02d}-{m[2]} "
                                   f"{(int(m[3]) + hours) % 24:02d}:{m[4]}:{m[5]}", text)
    text = _LINE.sub(lambda m: f"{m[1]}{max(1, int(m[2]) + shift)}", text)
    text = _ADDR.sub(lambda m: "0x" + "".join(rng.choice("0123456789abcdef")
                                              for _ in range(len(m[0]) - 2)), text)
    pids: dict[str, int] = {}
    text = _PID.sub(lambda m: f"{m[1]}{pids.setdefault(m[2], rng.randint(100, 999999))}", text)
    ips: dict[str, str] = {}
    text = _IP.sub(lambda m: ips.setdefault(m[0], f"10.{rng.randint(0, 255)}."
                                                  f"{rng.randint(0, 255)}.{rng.randint(1, 254)}"),
                   text)
    text = _PREFIX.sub(lambda m: prefix, text)
    text = _HOME.sub(lambda m: f"/home/user{rng.randint(1, 99)}/", text)
    text = _TP.sub(lambda m: f"{m[1]}{new_rank('tp', int(m[2]))}", text)
    text = _RANK.sub(lambda m: f"{m[1]}{new_rank('rank', int(m[2]))}", text)
    return text


Runner = Callable[[Case], Diagnosis]
