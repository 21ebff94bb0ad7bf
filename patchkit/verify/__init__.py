"""What checks the patch: dispatch facts, the CPU emulator, MLX parity, benches, the probe."""
