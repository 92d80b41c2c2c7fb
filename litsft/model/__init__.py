"""The network and what is computed from it, a folder a concern:

config.py, families/  the model config and one module per model family (its config and weight names)
network/              the Transformer itself: attention, MoE, batch layout, the loss, sample dropout
lora/                 LoRA layers, their settings and the adapter variants (lora/variants/)
precision/            NF4 quantization (QLoRA) and float8 training matmuls
accounting/           parameter and memory sizes, FLOPs
"""
