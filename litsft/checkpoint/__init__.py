"""Everything litsft stores on disk, by layer (the translations to and from Hugging Face are litsft.huggingface);
each module imports only the ones above it here (plain file writes are `litsft.runtime.files`):

    checkpoint_dirs      the step checkpoints in an out_dir: names, completeness, which one to resume from,
                         their trainer_state.json (no torch)
    weight_files         safetensors and .bin weights, read and written one tensor at a time
    sharded_tensors      tensors sharded across ranks in any placement, saved (as parts, or merged whole) and
                         loaded through torch.distributed.checkpoint's safetensors storage; the rank helpers
    model_folder         the litsft model folder: config, weights, tokenizer files, manifest (one writer)
    lora_folder          the folder finetune_lora writes: adapters, LoRA config, the base it was trained on
    training_checkpoint  resumable step checkpoints: sharded save, atomic publish, exact resume, rotation
    step_model           a step checkpoint written as the final/ folder its run would have had at that step
"""
