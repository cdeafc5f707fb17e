# The optional oneDNN kernels (jaxnn/kernels/onednn): `make install` (and so `make test` and `make test-all`) installs the onednn extra
# with the others (its wheels are marked for x86-64 Linux: elsewhere it installs nothing) and compiles the FFI
# library against it and jaxlib's XLA FFI headers, in seconds. Where there is no C++ compiler or no oneDNN, it says
# so and goes on: everything then runs on XLA's kernels.
.PHONY: onednn bench-onednn

ONEDNN_SRC := jaxnn/kernels/onednn/onednn_ffi.cc
ONEDNN_SO := jaxnn/kernels/onednn/libjaxnn_onednn.so.0

# The wheel puts the headers in $(VENV)/include and libdnnl.so.3 in $(VENV)/lib; the rpath is a fallback for
# jaxnn.kernels.onednn.library, which loads libdnnl from the environment first.
$(ONEDNN_SO): $(STAMP) $(ONEDNN_SRC)
	@if ! command -v $(CXX) >/dev/null 2>&1; then \
		echo "onednn: no C++ compiler ($(CXX)); the oneDNN kernels are not built, XLA's kernels are used"; \
	elif ! test -f $(VENV)/include/oneapi/dnnl/dnnl.hpp; then \
		echo "onednn: no oneDNN headers in $(VENV)/include; the oneDNN kernels are not built"; \
	else \
		echo "onednn: compiling $@"; \
		$(CXX) -O2 -std=c++17 -fopenmp -shared -fPIC -Wno-return-type \
			-isystem "$$($(PY) -c 'import jax.ffi; print(jax.ffi.include_dir())')" -I$(VENV)/include \
			$(ONEDNN_SRC) -L$(VENV)/lib -ldnnl -Wl,-rpath,$(abspath $(VENV))/lib -o $@; \
	fi

onednn: $(ONEDNN_SO) ## compile the optional oneDNN CPU kernels (part of `make install` where a compiler is present)

install test test-all: $(ONEDNN_SO)

bench-onednn: $(ONEDNN_SO) $(BENCH_STAMP) ## oneDNN kernels vs XLA vs PyTorch: primitives, then CNN/GPT steps (ARGS='--rounds 3')
	$(PY) -m benchmarks.onednn $(ARGS)
