"""Optional CPU kernels, compiled from source at install time: `jaxnn.kernels.onednn` (the `onednn` extra) calls
oneDNN's convolutions and bf16 matrix products from jitted programs through XLA's FFI. Without a compiler or the
extra nothing here is built, and every layer runs on XLA's own kernels."""
