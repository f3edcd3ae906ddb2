"""The OpenAI-compatible front door: auth, limits, upstream pool, usage ledger, metrics.

`deepserve gateway --upstream URL` runs it (server.py); `server.gateway_argv` builds that command line for a
supervisor. Nothing is imported here, so that reading GatewayConfig does not load the server's dependencies."""
