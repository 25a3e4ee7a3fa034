"""The single-host launcher behind `rlfabric up`: Redis plus every service as a child process."""
