"""What ptxas made of the kernels in built objects, read on any machine (no GPU needed): per kernel
its SASS instruction count and its loops (backward branches, with their instruction, HGMMA, MUFU
and BRA counts); given two objects, which kernels' SASS differs (register numbers included).

    python3 scripts/sass_report.py A.o                  # every kernel of A
    python3 scripts/sass_report.py OLD.o NEW.o          # the kernels whose SASS differs, both sides
    python3 scripts/sass_report.py --filter warpspec --min-loop 400 A.o

The objects come from any build of the extension: `BUILD_ONLY=1 bash scripts/tune_variants.sh
attention default: "old:-DKNOB=1"` leaves each variant's under /tmp/tune/attention/<build>/tmp,
`pip install -e .` under build/temp.*. Why: a short condition in the source can become many branches
in SASS (the window mask's `a && b && c` compiled to 62 branches a dk/dv tile), which the source does
not show.
"""
from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys

INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,6})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(\S*)\s*(.*?)\s*;")
FUNCTION = re.compile(r"^\s*Function : (\S+)")
BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")


def cuobjdump() -> str:
    """cuobjdump from PATH, the CUDA toolkit, or the copy Triton ships."""
    found = shutil.which("cuobjdump") or next(iter(glob.glob("/usr/local/cuda*/bin/cuobjdump")), None)
    if found is None:
        try:
            import triton
            bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
            found = bundled if os.path.exists(bundled) else None
        except ImportError:
            pass
    if found is None:
        sys.exit("sass_report: no cuobjdump (PATH, /usr/local/cuda*/bin or Triton's bundled copy)")
    return found


def kernel_names(path: str) -> list[str]:
    """The mangled names of the kernels (entry functions) in an object or library; fast, no SASS."""
    out = subprocess.run([cuobjdump(), "-symbols", path], check=True, capture_output=True, text=True).stdout
    return sorted({line.split()[-1] for line in out.splitlines() if "STO_ENTRY" in line})


def kernels(path: str, names: list[str] | None = None) -> dict[str, list[tuple[int, str, str]]]:
    """Kernel name -> its instructions as (address, opcode with modifiers, operands); `names`: only
    these kernels (cuobjdump -fun: a second instead of a minute for the whole extension)."""
    cmd = [cuobjdump(), "-sass"] + (["-fun", ",".join(names)] if names else []) + [path]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result: dict[str, list[tuple[int, str, str]]] = {}
    current = None
    for line in out.splitlines():
        m = FUNCTION.match(line)
        if m:
            current = m.group(1)
            result[current] = []
            continue
        m = INSTRUCTION.match(line)
        if m and current is not None:
            result[current].append((int(m.group(1), 16), m.group(3) + m.group(4), m.group(5)))
    return result


def loops(code: list[tuple[int, str, str]], min_loop: int) -> list[dict]:
    """Backward branches spanning at least min_loop bytes of code, innermost first."""
    found = []
    for addr, op, operands in code:
        if not op.startswith("BRA"):
            continue
        target = BRANCH_TARGET.search(operands)
        if target is None or int(target.group(1), 16) >= addr or addr - int(target.group(1), 16) < min_loop:
            continue
        start = int(target.group(1), 16)
        ops = collections.Counter(o.split(".")[0] for a, o, _ in code if start <= a <= addr)
        found.append({"start": start, "end": addr, "instructions": sum(ops.values()), "HGMMA": ops["HGMMA"],
                      "MUFU": ops["MUFU"], "BRA": ops["BRA"]})
    return sorted(found, key=lambda loop: loop["instructions"])


def digest(code) -> str:
    return hashlib.sha1("\n".join(f"{o} {operands}" for _, o, operands in code).encode()).hexdigest()


def describe(name: str, code, min_loop: int, readable: dict[str, str]) -> str:
    ops = collections.Counter(o.split(".")[0] for _, o, _ in code)
    head = (f"{len(code):6d} instructions  HGMMA {ops['HGMMA']:3d}  MUFU {ops['MUFU']:4d}  BRA {ops['BRA']:4d}  "
            f"{readable.get(name, name)}")
    body = [f"        loop 0x{lp['start']:x}-0x{lp['end']:x}: {lp['instructions']} instructions, HGMMA {lp['HGMMA']}, "
            f"MUFU {lp['MUFU']}, BRA {lp['BRA']}" for lp in loops(code, min_loop)]
    return "\n".join([head] + body)


def demangled(names) -> dict[str, str]:
    """Mangled -> readable, by one c++filt for all (the names themselves without it)."""
    names = sorted(names)
    filt = shutil.which("c++filt")
    if filt is None or not names:
        return {n: n for n in names}
    out = subprocess.run([filt], input="\n".join(names) + "\n", capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("objects", nargs="+", help="one object (report) or two (the kernels that differ)")
    parser.add_argument("--filter", default="", help="only kernels whose mangled name contains this")
    parser.add_argument("--min-loop", type=int, default=1600, help="smallest loop reported, in bytes of code (16 an instruction)")
    args = parser.parse_args(argv)
    if len(args.objects) > 2:
        parser.error("one object, or two to compare")
    sides = []
    for path in args.objects:
        names = [n for n in kernel_names(path) if args.filter in n]
        sides.append(kernels(path, names) if names else {})
    readable = demangled(set().union(*sides))
    if len(sides) == 1:
        for name, code in sorted(sides[0].items()):
            print(describe(name, code, args.min_loop, readable))
        return 0
    old, new = sides
    same = 0
    for name in sorted(set(old) | set(new)):
        if name in old and name in new and digest(old[name]) == digest(new[name]):
            same += 1
            continue
        for label, side in (("-", old), ("+", new)):
            print(f"{label} " + (describe(name, side[name], args.min_loop, readable) if name in side
                                 else f"(absent) {readable.get(name, name)}"))
    print(f"{same} kernels with the same SASS, {len(set(old) | set(new)) - same} differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
