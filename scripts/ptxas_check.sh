#!/usr/bin/env bash
# What ptxas makes of CUDA files, in seconds and without a GPU: each file to PTX (nvcc -ptx, the
# device code only: ~8 s for an attention instantiation) and then ptxas -v for sm_90a (~4 s), where a
# full `nvcc -c` takes 5-8 minutes on the development machine (the host compilation is the slow part).
# Prints each kernel's spills and ptxas's wgmma notes (C7515: "wgmma serialized", the
# one that costs every product of a kernel), and keeps the cubins for scripts/sass_report.py.
#
#   bash scripts/ptxas_check.sh [-DKNOB=1 ...] csrc/attention/instantiations/attention_fwd_bf16_hdim128.cu [...]
#   OUT_DIR=/tmp/ptxas_check (default): <file>.ptx, <file>.cubin, <file>.log
#   python3 scripts/sass_report.py /tmp/ptxas_check/a.cubin /tmp/ptxas_check/b.cubin   # SASS A/B
#
# The nvcc flags are setup.py's (NVCC_FLAGS) with its defines for TORCH_CUDA_ARCH_LIST=9.0a.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-/tmp/ptxas_check}
mkdir -p "$OUT_DIR"
defines=() files=()
for a in "$@"; do [[ $a == -D* ]] && defines+=("$a") || files+=("$a"); done
[ ${#files[@]} -gt 0 ] || { echo "usage: ptxas_check.sh [-DKNOB=1 ...] FILE.cu [...]"; exit 2; }
mapfile -t nvcc_flags < <(python3 -c "import setup; print('\n'.join(setup.NVCC_FLAGS))" 2>/dev/null)  # torch warns on import without a GPU
[ ${#nvcc_flags[@]} -gt 0 ] || { echo "ptxas_check.sh: no NVCC_FLAGS from setup.py"; exit 2; }
mapfile -t includes < <(python3 - <<'EOF'
import glob, os, site, sysconfig
sp = site.getsitepackages()[0]
ti = os.path.join(sp, "torch", "include")
for d in [ti, os.path.join(ti, "torch", "csrc", "api", "include"), *sorted(glob.glob(os.path.join(sp, "nvidia", "*", "include"))),
          sysconfig.get_paths()["include"]]:
    print("-I" + d)
EOF
)
status=0
for f in "${files[@]}"; do
  name=$(basename "$f" .cu)
  if ! nvcc "${nvcc_flags[@]}" -DFUSEFORGE_WITH_CUDA -DFUSEFORGE_SM90A_BUILD \
      -gencode arch=compute_90a,code=sm_90a "${defines[@]}" -Icsrc "${includes[@]}" -ptx "$f" -o "$OUT_DIR/$name.ptx"; then
    echo "== $f: nvcc failed"; status=1; continue
  fi
  ptxas -arch=sm_90a -O3 -v "$OUT_DIR/$name.ptx" -o "$OUT_DIR/$name.cubin" > "$OUT_DIR/$name.log" 2>&1 || status=1
  echo "== $f ${defines[*]}"
  # One line a kernel (its spills) and one a wgmma note (C75xx), kernel names shortened; registers: the .log.
  python3 - "$OUT_DIR/$name.log" <<'EOF'
import re, subprocess, sys
lines = open(sys.argv[1]).read().splitlines()
kernel = None
def short(mangled):
    out = subprocess.run(["c++filt"], input=mangled, capture_output=True, text=True).stdout.strip() or mangled
    return re.sub(r"fuseforge::\w+::", "", out)[:150]
for line in lines:
    m = re.search(r"Function properties for (\S+)", line)
    if m:
        kernel = m.group(1)
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and kernel:
        spills = f"spills {m.group(1)}/{m.group(2)} B" if m.group(1) != "0" or m.group(2) != "0" else "no spills"
        print(f"  {spills:<22} {short(kernel)}")
    m = re.search(r"\((C75\d\d)\) (.*?) in (?:the )?function '(\S+)'", line)
    if m:
        print(f"  {m.group(1)} {m.group(2)[:90]}  [{short(m.group(3))}]")
    if "error" in line.lower():
        print("  " + line)
EOF
done
exit $status
