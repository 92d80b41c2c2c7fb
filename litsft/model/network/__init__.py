"""The network: the Transformer (transformer.py) and its parts."""
