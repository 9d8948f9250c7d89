"""The fused collective + GEMM ops, one module per family."""
