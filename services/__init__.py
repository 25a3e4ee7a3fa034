"""rlfabric services: GRPO post-training as independent gRPC services (see docs/architecture.md)."""
