# Data pipeline and training targets. `make help` lists the lines with a `## ` comment.
.PHONY: bench-input train-gpt

bench-input: $(STAMP) ## step time and device-idle fraction, prefetch on/off, as host cost grows (ARGS=--capacity: host batches/s per core vs H200)
	$(PY) -m benchmarks.input_pipeline $(ARGS)

train-gpt: $(STAMP) ## train the byte-level GPT on the Python standard library's source and print a sample
	$(PY) -m jaxnn.cli train --model gpt --devices $(DEVICES) $(ARGS)
