"""Hugging Face interop, above the storage of litsft.checkpoint:

convert       Hugging Face and PEFT folders to and from litsft's (weights, config, adapters)
hub           `litsft download`: hub ids into the local cache
model_source  what a recipe's model argument names (hub id, litsft or HF folder) -> a litsft folder
"""
