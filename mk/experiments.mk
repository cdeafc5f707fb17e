# Experiments: each measures one claim of REPORT.md into results/<machine-tag>/, and the
# report turns every results folder present into REPORT.md. SIZE=quick|full|gpu|tiny; RESULTS is the results folder
# (not OUT: the GPU machine exports OUT for its own use, and make would read it).
SIZE ?= quick
RESULTS ?= results
# The experiments never replace results files git tracks (another machine's, or figures the docs cite): a rerun
# writes <name>-local.json beside them, which the report reads instead; RESULTS=elsewhere writes a new folder,
# OVERWRITE=1 replaces them.
OVERWRITE ?=
EXP_OUT = --out $(RESULTS)$(if $(OVERWRITE), --overwrite)
# gpu-check runs on a machine without network, from a plain checkout: the venv when one exists, else python3.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_ARGS ?=
# Where the GPU machine collects what it hands back ($OUT there): the results folder as one tar.gz and the two
# summaries. Unset (no OUT), nothing is archived.
GPU_ARCHIVE ?= $(if $(OUT),$(OUT)/)

.PHONY: exp-matmul exp-precision exp-sequential exp-pipeline exp-inference exp-parallel exp-train report \
	experiments gpu-check gpu-check-dry gpu-levers project-gpu

exp-matmul: $(STAMP) ## matmul GFLOP/s vs size (64..8192) per backend, next to the measured peak
	$(PY) -m experiments.exp_matmul --size $(SIZE) $(EXP_OUT)

exp-precision: $(STAMP) ## fp32/tf32/bf16/fp16 matmul and conv: speedup over fp32 and error vs float64
	$(PY) -m experiments.exp_precision --size $(SIZE) $(EXP_OUT)

exp-sequential: $(STAMP) ## dependent lax.scan chains and an RNN vs one equal-FLOP parallel product
	$(PY) -m experiments.exp_sequential --size $(SIZE) $(EXP_OUT)

exp-pipeline: $(STAMP) ## host augmentation: synchronous vs overlapped vs on-device, as its cost grows
	$(PY) -m experiments.exp_pipeline --size $(SIZE) $(EXP_OUT)

exp-inference: $(STAMP) ## CNN and GPT latency (p50/p99) and throughput vs batch size 1..4096
	$(PY) -m experiments.exp_inference --size $(SIZE) $(EXP_OUT)

exp-parallel: $(STAMP) ## training throughput vs device count (jit, shard_map, pmap) and vs batch size
	$(PY) -m experiments.exp_parallel --size $(SIZE) $(EXP_OUT)

exp-train: $(STAMP) ## CNN and GPT training in fp32, bf16, fp16 (loss scaling): curves, quality, speed
	$(PY) -m experiments.exp_train --size $(SIZE) $(EXP_OUT)

project-gpu: $(STAMP) ## compile every experiment's programs here: costs for REPORT.md's projected H200 column
	$(PY) -m experiments.projected --size $(SIZE) $(EXP_OUT)

report: $(STAMP) ## REPORT.md from every results/<machine-tag>/ present: per-claim tables, plots, verdicts
	$(PY) -m experiments.report --results $(RESULTS) --out REPORT.md

experiments: $(STAMP) ## all experiments at quick size (<10 min on 2 cores, progress bar), the projected column's costs, then the report
	$(PY) -m experiments.run_all --size $(SIZE) $(EXP_OUT)
	$(PY) -m experiments.projected --size $(SIZE) $(EXP_OUT)
	$(PY) -m experiments.report --results $(RESULTS) --out REPORT.md

gpu-check: ## on a GPU machine (no venv needed): check tensor cores, run every experiment at GPU size in <8 min
	PYTHONPATH=. $(GPU_PY) -m experiments.gpu_check --out $(RESULTS) $(if $(GPU_ARCHIVE),--archive $(GPU_ARCHIVE)) $(GPU_ARGS)

gpu-levers: ## on a GPU machine, after gpu-check when device time is left: each MFU lever against the plain bf16 step (~4 min)
	PYTHONPATH=. $(GPU_PY) -m benchmarks.mfu_levers --out-dir $(or $(OUT),results/bench/gpu-levers-$(BENCH_TIME)) $(GPU_ARGS)

gpu-check-dry: ## the gpu-check code path at tiny sizes on the CPU (GPU assertions skipped)
	PYTHONPATH=. $(GPU_PY) -m experiments.gpu_check --dry-run --out $${TMPDIR:-/tmp}/jaxnn-gpu-check-dry \
		--archive $(or $(GPU_ARCHIVE),$${TMPDIR:-/tmp}/jaxnn-gpu-check-dry-archive/) $(GPU_ARGS)
