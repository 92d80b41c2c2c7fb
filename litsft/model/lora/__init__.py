"""LoRA: the adapter layers (layers.py), their settings (config.py) and the variants (variants/)."""
