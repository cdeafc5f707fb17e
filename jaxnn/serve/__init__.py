"""Serving a trained model: `Engine` (continuous batching over a pool of cache slots, `engine`), the device
programs it runs (`slots`), and the OpenAI-compatible HTTP application of `jaxnn serve` (`api`)."""

from jaxnn.errors import ServerBusyError
from jaxnn.serve.engine import Engine, Request

__all__ = ["Engine", "ServerBusyError", "Request"]
