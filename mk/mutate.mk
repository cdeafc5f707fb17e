# Planted bugs, one at a time, against the fast tests that cover them (tools/mutate.py; docs/testing.md).
.PHONY: mutate

mutate: $(STAMP) ## plant each known bug in a copy of the library and check that the tests catch it
	$(PY) tools/mutate.py $(ARGS)
