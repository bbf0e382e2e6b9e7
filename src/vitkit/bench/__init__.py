"""Measuring speed: the machine's matmul ceiling, inference and training throughput against peers."""
