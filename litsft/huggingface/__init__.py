"""Hugging Face interop, above the storage of litsft.checkpoint:

convert       Hugging Face and PEFT folders to and from litsft's (weights, config, adapters)
hub           `litsft download`: hub ids into the local cache
model_source  what a command's model argument names (hub id, litsft or HF folder, step checkpoint) -> a litsft
              folder, or for convert's commands, a step checkpoint opened as its LoRA folder too
"""
