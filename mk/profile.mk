# Where the time goes, per layer: `jaxnn profile` for one model, and the roofline experiment behind REPORT.md.

.PHONY: profile exp-roofline

profile: $(STAMP) ## per-layer roofline of MODEL (cnn, gpt, mlp, resnet), fp32 and bf16; ARGS='--out DIR ...'
	$(PY) -m jaxnn.cli profile --model $(MODEL) $(ARGS)

exp-roofline: $(STAMP) ## the CNN's and GPT's per-layer roofline and projected GPU column for REPORT.md
	$(PY) -m experiments.roofline --size $(SIZE) $(EXP_OUT)
