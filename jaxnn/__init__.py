"""jaxnn: pure-functional neural-network layers and compiled training steps for JAX."""
