"""Generated Python bindings of the rlfabric gRPC contract (sources: protos/rlfabric/).

Do not edit the generated modules; change the .proto files and run `make proto`.
"""
