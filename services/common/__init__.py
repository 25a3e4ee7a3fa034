"""Code every service shares: config, wire formats, gRPC server/client helpers, Redis layer, metrics."""
