# Benchmarks against the peer libraries, and the GPU MFU check (benchmarks/). The peers live in the `bench` extra,
# never in the runtime deps.
.PHONY: bench-peers bench-generation bench-serve bench-gpu bench-gpu-dry install-bench bench-augment bench-lora bench-remat

BENCH_STAMP := $(VENV)/.installed-bench
# A fresh name for each run's results: results/bench/ holds committed measurements, which a rerun must not replace
# (the benchmarks refuse an existing --json file; ARGS='--json results/bench/x.json --overwrite' replaces one).
BENCH_TIME := $(shell date -u +%Y%m%dT%H%M%SZ)
# ISA=avx2 caps every library's instruction set the same way (XLA, oneDNN, PyTorch; benchmarks/isa.py).
ISA ?=

# torch is pinned (the interop extra, installed by `make install`): an unpinned torch would pull a newer CUDA build.
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,all,bench]'
	touch $(BENCH_STAMP)

install-bench: $(BENCH_STAMP) ## install the peer libraries (Flax, Equinox, Haiku, PyTorch) for bench-peers

bench-peers: $(STAMP) $(BENCH_STAMP) ## jaxnn vs Flax Linen/NNX, Equinox, Haiku, PyTorch: one table + JSON (ARGS='--rounds 3', ISA=avx2)
	$(PY) -m benchmarks.peers $(if $(ISA),--isa $(ISA)) $(ARGS)

bench-generation: $(STAMP) $(BENCH_STAMP) ## greedy decoding, GPT-2-small shape: jaxnn cache / no cache vs transformers (ARGS='--batch 1 8')
	$(PY) -m benchmarks.generation --json results/bench/generation-$(BENCH_TIME).json $(ARGS)

bench-serve: $(STAMP) $(BENCH_STAMP) ## jaxnn serve under load: tokens/s, TTFT, per-token latency at concurrency 1-64 vs one at a time vs transformers
	$(PY) -m benchmarks.serve --json results/bench/serve-$(BENCH_TIME).json $(ARGS)

bench-gpu: $(STAMP) ## GPT ~300M params, T=1024, bf16, fused attention: MFU vs the measured bf16 GEMM peak (GPU)
	$(PY) -m benchmarks.train_steps --gpu --out-dir results/bench/gpu-mfu-$(BENCH_TIME) $(ARGS)

bench-gpu-dry: $(STAMP) ## the bench-gpu code path at a tiny size, on the CPU
	$(PY) -m benchmarks.train_steps --gpu --dry-run --out-dir $${TMPDIR:-/tmp}/jaxnn-bench-gpu-dry $(ARGS)

bench-augment: $(STAMP) ## random crop+flip for the CNN on 32x32 images: host numpy vs inside the step (dm-pix), one run
	$(PY) -m benchmarks.augment_placement $(ARGS)

bench-remat: $(STAMP) ## remat policies: a GPT step's temporaries and time per policy at sequence lengths 512-4096, H200 projection
	$(PY) -m benchmarks.remat_memory --json results/bench/remat_memory-$(BENCH_TIME).json $(ARGS)

bench-lora: $(STAMP) ## LoRA r=8/16 vs full fine-tuning: trainable params, optimizer state, step memory and time, H200 projection
	$(PY) -m benchmarks.lora_memory --json results/bench/lora_memory-$(BENCH_TIME).json $(ARGS)
