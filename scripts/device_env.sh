# Sourced by the GPU-machine scripts (gpu_check.sh, e2e_gpu.sh, tune_variants.sh).
# The GPU image sets CXX=/opt/gcc/bin/g++, a wrapper that links libstdc++ statically into the
# extension; its stream code then formats into torch's stream objects and crashes on the first
# error message (a segfault in std::ostream::_M_insert<long> inside _C.abi3.so).
# Build with the system compiler, which links the shared libstdc++ torch uses.
if [ "${CXX:-}" = /opt/gcc/bin/g++ ] && [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
# The commit the benchmarks record (FUSEFORGE_COMMIT): the one given, else benchmarks/harness.py's
# git_commit() (HEAD, with "-dirty" where csrc, python or the benchmarks differ from it). A copied
# tree's .git can name an older commit than the tree, so give the sha as a literal in the command;
# "-dirty" marks a run that did not.
if [ -z "${FUSEFORGE_COMMIT:-}" ]; then
  FUSEFORGE_COMMIT=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import harness
print(harness.git_commit())" 2>/dev/null || echo unknown)
fi
export FUSEFORGE_COMMIT
# Warn where it shows: a table labelled with a stale commit cannot be traced to its code.
case "$FUSEFORGE_COMMIT" in
  *-dirty|unknown) echo "device_env.sh: FUSEFORGE_COMMIT=$FUSEFORGE_COMMIT (this copy's git state): pass the tree's sha as a literal, FUSEFORGE_COMMIT=<sha>" >&2 ;;
esac
# Peers that are pure Python + Triton (liger-kernel, cut-cross-entropy) travel as wheels in .whl/
# (git-ignored; copy it to the GPU machine with the tree). Source this after setting PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
fi
