"""Lower-precision weights and matmuls: NF4 quantization for QLoRA, float8 training matmuls."""
