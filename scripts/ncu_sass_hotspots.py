"""Reads `ncu --page source --print-source sass --csv` (SourceCounters collected) on stdin and prints
where the warps of one kernel spend their stall samples: the share of samples by opcode and the
instructions with the most samples, each with its neighbours' opcodes (the wait an instruction sits
behind is often the one before it). Used by tuning_probe.sh (ATTN_NCU_SOURCE=1).
  ncu ... --page source --print-source sass --csv python3 ... | python3 scripts/ncu_sass_hotspots.py [TOP]
"""
import csv
import re
import sys
from collections import Counter


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def main():
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    lines = [line for line in sys.stdin if line.startswith('"')]
    if not lines:
        print("no csv rows (was SourceCounters collected?)")
        return
    rows = list(csv.reader(lines))
    start = next((i for i, r in enumerate(rows) if "Source" in r and any("Sampling" in h for h in r)), None)
    if start is None:
        print("no header with Source and stall sampling columns; the first rows:")
        for r in rows[:5]:
            print("  ", r[:8])
        return
    header, body = rows[start], rows[start + 1:]
    source = next(i for i, h in enumerate(header) if h == "Source")
    samples = next(i for i, h in enumerate(header) if "Sampling" in h and "All" in h)
    executed = next((i for i, h in enumerate(header) if h == "Instructions Executed"), None)
    body = [r for r in body if len(r) > max(source, samples)]
    total = sum(number(r[samples]) for r in body) or 1.0
    by_op = Counter()
    for r in body:
        by_op[re.sub(r"^@!?U?P\w+\s+", "", r[source].strip()).split(" ")[0]] += number(r[samples])
    print(f"{len(body)} SASS lines, {total:.0f} stall samples; by opcode:")
    for op, n in by_op.most_common(12):
        print(f"  {op:32s} {100 * n / total:5.1f}%")
    print(f"top {top} instructions (index, samples %, executed, instruction | previous opcode):")
    ranked = sorted(range(len(body)), key=lambda i: -number(body[i][samples]))[:top]
    for i in sorted(ranked):
        r = body[i]
        prev = body[i - 1][source].strip().split(" ")[0] if i > 0 else ""
        ex = f"{number(r[executed]):.0f}" if executed is not None else ""
        print(f"  {i:5d} {100 * number(r[samples]) / total:5.1f}% {ex:>10s}  {r[source].strip()[:70]:70s} | {prev}")


if __name__ == "__main__":
    main()
