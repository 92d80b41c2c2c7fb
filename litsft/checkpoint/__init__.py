"""Everything litsft reads from and writes to disk, and the translations to and from Hugging Face, by layer;
each module imports only the ones above it here (plain file writes are `litsft.runtime.files`):

    checkpoint_dirs      the step checkpoints in an out_dir: names, completeness, which one to resume from,
                         their trainer_state.json (no torch)
    weight_files         safetensors and .bin weights, read and written one tensor at a time
    sharded_tensors      tensors sharded across ranks in any placement, saved (as parts, or merged whole) and
                         loaded through torch.distributed.checkpoint's safetensors storage; the rank helpers
    model_folder         the litsft model folder: config, weights, tokenizer files, manifest (one writer)
    lora_folder          the folder finetune_lora writes: adapters, LoRA config, the base it was trained on
    training_checkpoint  resumable step checkpoints: sharded save, atomic publish, exact resume, rotation
    convert              Hugging Face and PEFT folders to and from litsft's (weights, config, adapters)
    hub                  `litsft download`: hub ids into the local cache
    model_source         what a recipe's model argument names (hub id, litsft or HF folder) -> a litsft folder
"""
