"""The OpenAI-compatible front door: auth, limits, upstream pool, usage ledger, metrics.

`deepserve gateway --upstream URL` runs it; `gateway_argv` builds that command line for a supervisor."""

from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.server import READY_PREFIX, gateway_argv

__all__ = ["READY_PREFIX", "GatewayConfig", "gateway_argv"]
