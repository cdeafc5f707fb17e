# Parallel training: benchmarks of the data-parallel forms and the sharding layouts, and two local processes.
# PARALLEL_ARGS is passed to either script (see `python -m benchmarks.data_parallel --help`,
# `python -m jaxnn.cli.multihost --help`; arguments after `--` go to every `jaxnn train` worker).
PARALLEL_ARGS ?=
NUM_PROCESSES ?= 2

.PHONY: bench-parallel bench-sharding train-multihost

bench-parallel: $(STAMP) ## step time and throughput vs device count (1,2,4,8) for jit, shard_map and pmap; then bench-sharding
	$(PY) -m benchmarks.data_parallel $(PARALLEL_ARGS)
	$(PY) -m benchmarks.sharding_layouts $(ARGS)

bench-sharding: $(STAMP) ## the GPT under dp, fsdp, tensor x fsdp, data x fsdp: state bytes per device, collectives per step
	$(PY) -m benchmarks.sharding_layouts $(ARGS)

train-multihost: $(STAMP) ## two local processes (gloo on 127.0.0.1) train the MLP on digits together
	$(PY) -m jaxnn.cli.multihost --num-processes $(NUM_PROCESSES) $(PARALLEL_ARGS)
