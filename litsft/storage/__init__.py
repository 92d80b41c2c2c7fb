"""Everything litsft reads from and writes to disk, by layer; each module imports only the ones above it here:

    files                plain files, no torch: JSON with one-line errors, durable writes, and the one
                         "write into a staging directory, then rename" publish (`publish_atomically`)
    checkpoint_dirs      the step checkpoints in an out_dir: names, completeness, which one to resume from,
                         their trainer_state.json (no torch)
    weight_files         safetensors and .bin weights, read and written one tensor at a time
    sharded_rows         which rows of a (possibly FSDP-sharded) tensor this rank holds, and reading rows
                         of tensors stored as row blocks; the rank helpers they need
    model_folder         the litsft model folder: config, weights, tokenizer files, manifest (one writer)
    lora_folder          the folder finetune_lora writes: adapters, LoRA config, the base it was trained on
    training_checkpoint  resumable step checkpoints: sharded save, atomic publish, exact resume, rotation

Conversions to and from Hugging Face and PEFT are not storage but translation: they live in litsft.convert.
"""
