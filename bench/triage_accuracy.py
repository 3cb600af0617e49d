"""Triage accuracy of ``hicache doctor`` on the corpus of real crash reports.

For every case of ``tests/corpus/cases`` (a verbatim excerpt of a public crash report and its
label, decided from the catalog's definitions before the doctor saw it) the doctor's top-1 answer
is its first verdict, or ``none`` when it names nothing. Reported, in one run:

* top-1 accuracy on the positives (a signature is the label) and on the hard negatives (``none``);
* the same on a perturbed copy of every case (other install paths, ranks, line numbers,
  timestamps, addresses, pids: the same failure printed by another deployment);
* calibration: for verdicts in each confidence band, how often they were right;
* every case the doctor got wrong, with what it said.

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

from tests.corpus import NONE, Case, answer, diagnose_bytes, load_cases, perturb

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="seed of the perturbed copy")
    ap.add_argument("--quiet", action="store_true", help="only the summary and the JSON line")
    args = ap.parse_args()
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
                      "wrong_at_0.8": wrong_high}))


if __name__ == "__main__":
    main()
