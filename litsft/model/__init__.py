"""The network and what is computed from it: model config and families, attention, the Transformer, the loss, batch layout, sizes and FLOPs, LoRA and NF4 quantization."""
