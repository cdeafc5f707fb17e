"""Where a model's time goes, layer by layer, on the machine at hand, against a measured roofline.

    prof = jaxnn.profile.profile_layers(model, (28, 28, 1), batch_size=64, policy="bf16")
    print(prof)

- `measure.py`: the machine's ceilings (`measure_peaks`) and the per-layer measurement (`profile_layers`);
- `results.py`: what is measured, as values (`MachinePeaks`, `LayerRow`, `Profile`) and the table they print as;
- `projection.py`: an accelerator's lower bound for the same FLOPs and bytes (`Accelerator`, `accelerator`), and
  the GPU model of REPORT.md's projected column (`GpuModel`, `ProgramCost`);
- `program_cost.py`: a compiled program's cost as that model reads it (FLOPs, bytes, kernels, loop iterations);
- `plots.py`: the roofline and per-layer time as PNG files (matplotlib).
"""

from jaxnn.profile.measure import describe_device, measure_peaks, profile_layers
from jaxnn.profile.projection import Accelerator, ProjectionError, accelerator
from jaxnn.profile.results import PASSES, LayerRow, MachinePeaks, Profile, ProfileError, format_profile

__all__ = [
    "PASSES",
    "Accelerator",
    "LayerRow",
    "MachinePeaks",
    "Profile",
    "ProfileError",
    "ProjectionError",
    "accelerator",
    "describe_device",
    "format_profile",
    "measure_peaks",
    "profile_layers",
]
