"""Triage accuracy of ``hicache doctor`` on the corpus of real crash reports.

For every case of ``tests/corpus/cases`` (a verbatim excerpt of a public crash report and its
label, decided from the catalog's definitions before the doctor saw it) the doctor's top-1 answer
is its first verdict, or ``none`` when it names nothing. Reported, in one run:

* top-1 accuracy on the positives (a signature is the label) and on the hard negatives (``none``);
* the same on a perturbed copy of every case (other install paths, ranks, line numbers,
  timestamps, addresses, pids: the same failure printed by another deployment);
* calibration: for verdicts in each confidence band, how often they were right;
* per round of reports: the first look (``tests/corpus/first_look.yaml``: the doctor's answers
  before anything was changed for that round) beside today's answers on the same cases;
* every case the doctor got wrong, with what it said.

``--first-look DIR --round N`` diagnoses a new round (cases not yet in the corpus) once,
records every answer and the totals in ``first_look.yaml`` and refuses to run again for that
round: the first look is what the doctor knew before it saw those reports.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml

from tests.corpus import (
    FIRST_LOOK,
    NONE,
    Case,
    answer,
    diagnose_bytes,
    load_cases,
    perturb,
)

BANDS = [(0.5, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.01)]


def _run(cases: list[Case], perturbed: bool, seed: int) -> list[tuple[Case, str, float]]:
    out = []
    for i, c in enumerate(cases):
        data = c.text
        if perturbed:
            data = perturb(c.text.decode("utf-8", errors="replace"), seed + i).encode("utf-8")
        said, conf = answer(diagnose_bytes(f"{c.id}.log", data))
        out.append((c, said, conf))
    return out


def _acc(rows: list[tuple[Case, str, float]], positive: bool | None) -> tuple[float, int]:
    sel = [r for r in rows if positive is None or r[0].positive == positive]
    if not sel:
        return 0.0, 0
    return sum(said in c.label for c, said, _ in sel) / len(sel), len(sel)


def _totals(rows: list[tuple[Case, str, float]]) -> dict[str, int]:
    pos = [r for r in rows if r[0].positive]
    neg = [r for r in rows if not r[0].positive]
    return {"cases": len(rows), "right": sum(said in c.label for c, said, _ in rows),
            "positives": len(pos), "positives_named": sum(said in c.label for c, said, _ in pos),
            "negatives": len(neg), "negatives_right": sum(said in c.label for c, said, _ in neg),
            "wrong_at_0_8": sum(said not in c.label and said != NONE and conf >= 0.8
                                for c, said, conf in rows)}


def first_look(folder: Path, round_name: str) -> None:
    """Diagnose a new round once and record it (see the module docstring)."""
    record = yaml.safe_load(FIRST_LOOK.read_text(encoding="utf-8"))
    if any(str(r["round"]) == round_name for r in record["rounds"]):
        raise SystemExit(f"round {round_name} already had its first look; it is not taken again")
    cases = load_cases(folder)
    if not cases:
        raise SystemExit(f"no cases in {folder}")
    rows = _run(cases, False, 0)
    totals = _totals(rows)
    from signatures.loader import load_catalog
    lines = [f'  - round: "{round_name}"', f"    date: {time.strftime('%Y-%m-%d')}",
             f"    catalog: {load_catalog().version}"]
    lines += [f"    {k}: {v}" for k, v in totals.items()]
    lines.append("    answers:")
    lines += [f"      {c.id}: [{said}, {conf}]" for c, said, conf in rows]
    with FIRST_LOOK.open("a", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"round {round_name} first look: {totals['right']}/{totals['cases']} right, positives "
          f"{totals['positives_named']}/{totals['positives']}, negatives "
          f"{totals['negatives_right']}/{totals['negatives']}, wrong at >= 0.8: "
          f"{totals['wrong_at_0_8']}")
    for c, said, conf in rows:
        mark = "ok  " if said in c.label else "MISS"
        print(f"  {mark} {c.id}: said {said} ({conf:.2f}), label {list(c.label)}")
    print(json.dumps({"bench": "triage_first_look", "round": round_name, **totals}))


def _rounds(plain: list[tuple[Case, str, float]]) -> list[dict[str, object]]:
    """Per recorded round: the first look's totals and today's on the same cases."""
    record = yaml.safe_load(FIRST_LOOK.read_text(encoding="utf-8"))
    out = []
    for r in record["rounds"]:
        name = str(r["round"])
        now = [row for row in plain if row[0].round == name]
        entry: dict[str, object] = {"round": name, "first_look": {
            k: r.get(k) for k in ("cases", "right", "positives", "positives_named", "negatives",
                                  "negatives_right", "wrong_at_0_8")}}
        if now:
            entry["now"] = _totals(now)
            decidable = [row for row in now if row[0].positive and row[0].decides]
            answers = r.get("answers") or {}
            entry["first_look_decidable_positives"] = [
                sum(answers.get(c.id, [NONE])[0] in c.label for c, _, _ in decidable),
                len(decidable)]
        out.append(entry)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="seed of the perturbed copy")
    ap.add_argument("--quiet", action="store_true", help="only the summary and the JSON line")
    ap.add_argument("--first-look", type=Path, metavar="DIR",
                    help="diagnose the new round in DIR once and record it (with --round)")
    ap.add_argument("--round", help="the name of the round --first-look records")
    args = ap.parse_args()
    if args.first_look is not None:
        if not args.round:
            ap.error("--first-look needs --round")
        first_look(args.first_look, args.round)
        return
    cases = load_cases()
    t0 = time.perf_counter()
    plain = _run(cases, False, args.seed)
    pert = _run(cases, True, args.seed)
    wall = time.perf_counter() - t0
    pos, n_pos = _acc(plain, True)
    neg, n_neg = _acc(plain, False)
    allp, _ = _acc(plain, None)
    ppos, _ = _acc(pert, True)
    pneg, _ = _acc(pert, False)
    pall, _ = _acc(pert, None)
    print(f"{len(cases)} cases ({n_pos} positives, {n_neg} hard negatives), "
          f"{wall / (2 * len(cases)) * 1000:.0f} ms per diagnosis")
    print(f"top-1 positives {pos:.3f}  negatives {neg:.3f}  all {allp:.3f}")
    print(f"perturbed: positives {ppos:.3f}  negatives {pneg:.3f}  all {pall:.3f}")
    bands: dict[tuple[float, float], list[bool]] = defaultdict(list)
    for c, said, conf in plain + pert:
        if said == NONE:
            continue
        for lo, hi in BANDS:
            if lo <= conf < hi:
                bands[(lo, hi)].append(said in c.label)
    print("calibration (named verdicts, plain + perturbed):")
    for lo, hi in BANDS:
        rs = bands[(lo, hi)]
        acc = f"{sum(rs) / len(rs):.3f}" if rs else "  -  "
        print(f"  confidence [{lo:.1f}, {min(hi, 1.0):.1f}{']' if hi > 1 else ')'}: "
              f"{len(rs):4d} verdicts, right {acc}")
    high = [ok for (lo, _), rs in bands.items() if lo >= 0.8 for ok in rs]
    wrong_high = len(high) - sum(high)
    rounds = _rounds(plain)
    print("per round (first look -> now; positives named of all, and of those whose excerpt "
          "shows the deciding line):")
    for r in rounds:
        fl = r["first_look"]
        assert isinstance(fl, dict)
        now = r.get("now")
        line = (f"  round {r['round']}: first look {fl['right']}/{fl['cases']} right, positives "
                f"{fl['positives_named']}/{fl['positives']}")
        if isinstance(now, dict):
            dec = r["first_look_decidable_positives"]
            assert isinstance(dec, list)
            line += (f" ({dec[0]}/{dec[1]} decidable); now {now['right']}/{now['cases']}, "
                     f"positives {now['positives_named']}/{now['positives']}")
        print(line)
    decided = [row for row in plain if row[0].positive and row[0].decides]
    dec_acc = sum(said in c.label for c, said, _ in decided) / max(1, len(decided))
    if not args.quiet:
        print("wrong answers (plain):")
        for c, said, conf in plain:
            if said not in c.label:
                print(f"  {c.id}: said {said} ({conf:.2f}), label {list(c.label)}")
        print("wrong answers (perturbed only):")
        for (c, said, conf), (_, said0, _) in zip(pert, plain):
            if said not in c.label and said0 in c.label:
                print(f"  {c.id}: said {said} ({conf:.2f}), label {list(c.label)}")
    print(json.dumps({"bench": "triage_accuracy", "cases": len(cases), "positives": n_pos,
                      "negatives": n_neg, "top1_positive": round(pos, 3),
                      "top1_negative": round(neg, 3), "top1": round(allp, 3),
                      "top1_perturbed": round(pall, 3),
                      "top1_perturbed_positive": round(ppos, 3),
                      "top1_perturbed_negative": round(pneg, 3),
                      "high_confidence_verdicts": len(high),
                      "high_confidence_precision": round(sum(high) / len(high), 3)
                      if high else None,
                      "wrong_at_0.8": wrong_high,
                      "top1_decidable_positive": round(dec_acc, 3),
                      "rounds": rounds}))


if __name__ == "__main__":
    main()
