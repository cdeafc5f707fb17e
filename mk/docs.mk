# Documentation: the guide pages of docs/ and the API reference from the docstrings, built offline with pdoc.
.PHONY: docs

docs: $(STAMP) ## build/docs/index.html: the guide and the API reference; fails on a missing docstring or a broken link
	$(PY) tools/build_docs.py --out build/docs
