"""jaxnn's internals: plumbing the public modules share (whole-file writes, run ownership, optional imports, the
compilation cache, pytree helpers). Not part of the API: names here may change without notice."""
