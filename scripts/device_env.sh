# Sourced by the GPU-machine scripts (gpu_check.sh, tune_variants.sh).
# The GPU image sets CXX=/opt/gcc/bin/g++, a wrapper that links libstdc++ statically into the
# extension; its stream code then formats into torch's stream objects and crashes on the first
# error message (seen 2026-11-23: a segfault in std::ostream::_M_insert<long> inside _C.abi3.so).
# Build with the system compiler, which links the shared libstdc++ torch uses.
if [ "${CXX:-}" = /opt/gcc/bin/g++ ] && [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
