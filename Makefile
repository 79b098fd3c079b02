# fuseforge: the two commands are `make demo` and `make test`; both set up what they need.
PYTHON ?= python3
JOBS ?= $(shell nproc)
export PYTHONPATH := $(CURDIR)/python$(if $(PYTHONPATH),:$(PYTHONPATH))
TORCH_CMAKE = $(shell $(PYTHON) -c "import torch.utils; print(torch.utils.cmake_prefix_path)")

.PHONY: all setup build build-dev wheel test test-python test-cpp demo bench gpu-check clean

all: build

setup:
	$(PYTHON) scripts/ensure_deps.py

# Incremental (ninja) in-place build of fuseforge._C: CPU-only unless a GPU is visible (FUSEFORGE_CUDA=1
# forces the CUDA kernels; docs/install.md). Objects live in build/temp-<cpu|cuda>, which
# `pip install --no-build-isolation [-e] .` and `make wheel` reuse.
build: setup
	MAX_JOBS=$(JOBS) $(PYTHON) setup.py -q build_ext --inplace

# The same with the development knobs compiled in (FUSEFORGE_DEV=1, csrc/common/env.h), in its own build
# folder: the tests that force kernel paths through them run only against this build.
build-dev: setup
	FUSEFORGE_DEV=1 MAX_JOBS=$(JOBS) $(PYTHON) setup.py -q build_ext --inplace

# dist/fuseforge-<version>-cp39-abi3-<platform>.whl, for this torch (and CUDA, in a CUDA build).
wheel: setup
	MAX_JOBS=$(JOBS) $(PYTHON) -m pip wheel . --no-build-isolation --no-deps -q -w dist

test: build-dev
	$(PYTHON) -m pytest -q tests/python; status=$$?; [ $$status -eq 0 ] || exit $$status
	$(MAKE) --no-print-directory test-cpp

test-python: build-dev
	$(PYTHON) -m pytest -q tests/python

test-cpp: setup
	$(PYTHON) scripts/ensure_deps.py --gtest
	mkdir -p build
	cmake -S . -B build/cpp -G Ninja -DCMAKE_PREFIX_PATH="$(TORCH_CMAKE)" -DCMAKE_BUILD_TYPE=Release > build/cpp-configure.log 2>&1 || (cat build/cpp-configure.log; exit 1)
	cmake --build build/cpp -j $(JOBS)
	ctest --test-dir build/cpp --output-on-failure

demo: build
	$(PYTHON) examples/demo.py

bench: build
	for b in benchmarks/bench_*.py; do $(PYTHON) $$b || exit 1; done

# On a GPU machine: build, all tests, compute-sanitizer, benchmarks (see scripts/gpu_check.sh).
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf build dist python/fuseforge/_C*.so python/fuseforge/_build_info.py
