"""rlfabric.v1: generated from protos/rlfabric/v1/*.proto by `make proto`."""
