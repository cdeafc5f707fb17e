"""The former name of `python -m jaxnn.profile.onednn_calibration`, kept so that commands written for it still run.

The measurement moved to the profiler because it times the layers and products above this package; this module
starts it by name (as `choice` does) rather than importing it, so the kernels' package imports nothing above `_src`.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("jaxnn.profile.onednn_calibration", run_name="__main__", alter_sys=True)
