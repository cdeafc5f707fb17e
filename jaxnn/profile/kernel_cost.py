"""FLOPs and bytes of jaxnn's oneDNN kernel calls in a program's HLO text, which XLA's cost analysis cannot see into
(`timing.cost_counts` adds them). Counted in `jaxnn._src.kernel_cost`, below the layers that count FLOPs too;
this module keeps the public names."""

from jaxnn._src.kernel_cost import KERNELS, kernel_costs

__all__ = ["KERNELS", "kernel_costs"]
