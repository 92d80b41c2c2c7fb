"""TRL's own DPOTrainer (trl 1.16) as an independent reference for litsft's preference objectives: tests
train a tiny Hugging Face model on already tokenized pairs with it and compare losses, rewards and weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
from trl import DPOConfig, DPOTrainer

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


class _PretokenizedDPOTrainer(DPOTrainer):
    """DPOTrainer fed prompt_ids/chosen_ids/rejected_ids as given, recording every step's own metrics."""

    step_logs: list[dict[str, float]]

    def _prepare_dataset(self, dataset: Dataset, *args: Any, **kwargs: Any) -> Dataset:
        # TRL 1.16 always extracts the prompt, appends EOS and tokenizes text columns; our pairs are already the
        # exact token ids to score, and its collator reads these three columns directly.
        return dataset

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> Any:
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            # TRL appends one value per forward to self._metrics and log() averages them over the logging
            # window; the last entry is this step's own value, taken before the optimizer step.
            metrics = self._metrics["train"]
            value = loss[0] if return_outputs else loss
            self.step_logs.append({"loss": value.item(), **{k: metrics[k][-1] for k in METRICS}})
        return loss


def _loss_setup(loss_type: str, label_smoothing: float) -> dict[str, Any]:
    if label_smoothing == 0.0:
        return {"loss_type": [loss_type]}
    if loss_type != "sigmoid" or not 0.0 < label_smoothing < 0.5:
        raise ValueError(f"label smoothing {label_smoothing} is only defined here for sigmoid, in (0, 0.5)")
    # TRL 1.16's "sigmoid" ignores label_smoothing. The conservative-DPO loss
    #   -(1 - ls) logsigmoid(b d) - ls logsigmoid(-b d)
    # equals 2(1 - ls) * sigmoid - (1 - 2 ls) * robust, with robust = (-(1 - ls) logsigmoid(b d) +
    # ls logsigmoid(-b d)) / (1 - 2 ls), so TRL's own two terms are combined with those weights.
    ls = label_smoothing
    return {"loss_type": ["sigmoid", "robust"], "loss_weights": [2 * (1 - ls), -(1 - 2 * ls)]}


def trl_preference_run(
    hf_dir: Path,
    pairs: list[tuple[list[int], list[int], list[int]]],
    out_dir: Path,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    steps: int = 3,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    max_grad_norm: float | None = 1.0,
    lora: dict | None = None,
    initial_adapters: dict[str, torch.Tensor] | None = None,
) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """Train `steps` optimizer steps with TRL's DPOTrainer, each on all `pairs` (prompt, chosen, rejected token
    ids; chosen/rejected are the scored completions, used as given) as one batch, fp32 on CPU, AdamW at a
    constant `lr`, reference log-probs precomputed from the initial model. With `lora` (LoraConfig kwargs)
    only adapters train and the reference is the base model; `initial_adapters` (a PEFT adapter state dict)
    replaces PEFT's random initialization, so that both trainers start from the same adapters. Returns one dict of TRL's metrics per step
    (loss, rewards/*, logps/*, before that step's update) and the final weights: the full state dict, or
    with `lora` the adapter state dict as PEFT saves it."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    dataset = Dataset.from_dict(
        {
            "prompt_ids": [list(p) for p, _, _ in pairs],
            "chosen_ids": [list(c) for _, c, _ in pairs],
            "rejected_ids": [list(r) for _, _, r in pairs],
        }
    )
    args = DPOConfig(
        output_dir=str(out_dir),
        **_loss_setup(loss_type, label_smoothing),
        beta=beta,
        label_smoothing=label_smoothing,
        precompute_ref_log_probs=True,
        max_length=None,  # no truncation: TRL scores prompt + completion whole
        padding_free=False,
        per_device_train_batch_size=len(pairs),
        precompute_ref_batch_size=len(pairs),
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",  # torch.optim.AdamW (transformers 5 defaults to the fused variant)
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_epsilon=eps,
        weight_decay=0.0,
        max_grad_norm=max_grad_norm or 0.0,  # Trainer clips only when max_grad_norm > 0; None would crash
        gradient_checkpointing=False,  # TRL defaults it on
        bf16=False,  # TRL defaults it on
        fp16=False,
        use_cpu=True,
        seed=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_drop_last=False,
    )
    peft_config = LoraConfig(**{"task_type": "CAUSAL_LM", "lora_dropout": 0.0, **lora}) if lora else None
    trainer = _PretokenizedDPOTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    if initial_adapters is not None:
        set_peft_model_state_dict(trainer.model, initial_adapters)
    trainer.remove_callback(PrinterCallback)  # disable_tqdm swaps the progress bar for printed logs
    trainer.step_logs = []
    trainer.train()
    trained = trainer.model
    state = get_peft_model_state_dict(trained) if lora else trained.state_dict()
    return trainer.step_logs, {name: tensor.detach().clone() for name, tensor in state.items()}
