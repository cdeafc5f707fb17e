"""Where a model's time goes, layer by layer, on the machine at hand, against a measured roofline.

    prof = jaxnn.profile.profile_layers(model, (28, 28, 1), batch_size=64, policy="bf16")
    print(prof)

- `measure.py`: the machine's ceilings (`measure_peaks`) and the per-layer measurement (`profile_layers`);
- `results.py`: what is measured, as values (`MachinePeaks`, `LayerRow`, `Profile`) and the table they print as;
- `projection.py`: an accelerator's lower bound for the same FLOPs and bytes (`Accelerator`, `accelerator`), and
  the GPU model of REPORT.md's projected column (`GpuModel`, `ProgramCost`);
- `program_cost.py`: a compiled program's cost as that model reads it (FLOPs, bytes, kernels, loop iterations);
- `plots.py`: the roofline and per-layer time as PNG files (matplotlib);
- `timing.py`: timing that waits for the device, FLOP counts from the compiler, the measured matmul peak (what
  the benchmarks and experiments time with);
- `kernel_cost.py`: the FLOPs and bytes of jaxnn's oneDNN kernel calls, which XLA's cost analysis cannot see into
  (`timing.cost_counts` adds them; both are counted in `jaxnn._src`, below the layers' summary that reads them);
- `onednn_calibration.py`: which oneDNN kernels beat jaxnn's own CPU paths on this machine
  (`python -m jaxnn.profile.onednn_calibration`, started by `jaxnn.kernels.onednn.choice` once per machine);
- `trace.py`: a `jax.profiler` trace of a few training steps (`fit(..., profile_dir=DIR)`).
- `kernel_table.py`: where a traced program's device time went, operation by operation and by kind
  (`python -m jaxnn.profile.kernel_table DIR`).

The names below are imported on first use, so that `import jaxnn.profile.timing` (what benchmarks time with) does
not load the profiler.
"""

from jaxnn._src.lazy import lazy_exports

_NAMES = {
    "describe_device": "measure",
    "measure_peaks": "measure",
    "profile_layers": "measure",
    "Accelerator": "projection",
    "ProjectionError": "projection",
    "accelerator": "projection",
    "PASSES": "results",
    "LayerRow": "results",
    "MachinePeaks": "results",
    "Profile": "results",
    "ProfileError": "results",
    "format_profile": "results",
}
SUBMODULES = (
    "kernel_cost",
    "kernel_table",
    "measure",
    "onednn_calibration",
    "plots",
    "program_cost",
    "projection",
    "results",
    "timing",
    "trace",
)


__getattr__, __dir__ = lazy_exports("jaxnn.profile", _NAMES, SUBMODULES)

__all__ = sorted(_NAMES)
