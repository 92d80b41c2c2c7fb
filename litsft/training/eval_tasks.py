"""`--eval.tasks`: lm-evaluation-harness tasks scored at every validation on the model being trained.

The live model is scored, sharded as it trains: no export and no second copy. Every process builds every
request (so few-shot examples are drawn as `litsft evaluate` draws them) and scores a share of them; under
FSDP2 their forward passes are kept in lockstep (`litsft.inference.lockstep`). The numbers are those of
`litsft evaluate` on a checkpoint saved at the same step.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from lightning.fabric import Fabric
from torch import nn

from litsft.training.args import EvalConfig

# lm_eval's results entries that are not scores.
_NOT_SCORES = ("alias", "sample_len", "samples")


class TrainingTasks:
    """The tasks of `--eval.tasks`, found once (lm_eval indexes its task files when asked).

    Args:
        config: The run's `--eval.*` options.
        tokenizer: The model's litsft tokenizer.
        name: What the results name the model by (the run's out_dir).
    """

    def __init__(self, config: EvalConfig, tokenizer: Any, name: str) -> None:
        from litsft.inference.evaluate import find_tasks

        self.config, self.tokenizer, self.name = config, tokenizer, name
        self.task_manager, self.tasks = find_tasks(config.tasks, config.include_path)

    def score(self, fabric: Fabric, model: nn.Module) -> dict[str, Any]:
        """lm_eval's results of the tasks on `model` as it is now, on every rank. The random generators
        are left as they were: lm_eval seeds them, and the training run must not notice it ran."""
        from litsft.inference.evaluate import LitsftLM, run_tasks
        from litsft.inference.lockstep import Lockstep

        lockstep = Lockstep(model) if fabric.world_size > 1 else None
        lm = LitsftLM(
            model,
            self.tokenizer,
            self.name,
            self.config.batch_size,
            rank=fabric.global_rank,
            processes=fabric.world_size,
            lockstep=lockstep,
            progress=False,
        )
        python_state, numpy_state = random.getstate(), np.random.get_state()
        devices = [fabric.device] if fabric.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                return run_tasks(
                    lm,
                    self.task_manager,
                    self.tasks,
                    num_fewshot=self.config.num_fewshot,
                    limit=self.config.limit,
                    apply_chat_template=self.config.apply_chat_template,
                    fewshot_as_multiturn=self.config.fewshot_as_multiturn,
                    confirm_run_unsafe_code=self.config.confirm_run_unsafe_code,
                    bootstrap_iters=0,  # standard errors by bootstrap take seconds per metric, each validation
                )
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
            if lockstep is not None:
                lockstep.close()


def task_scores(results: dict[str, Any]) -> dict[str, float]:
    """The scores of lm_eval's results as `task/metric` (a filter other than "none" appended as
    `task/metric/filter`) -> value, tasks and groups alike; standard errors left out."""
    scores = {}
    for section in ("results", "groups"):
        for task, entries in results.get(section, {}).items():
            for key, value in entries.items():
                metric, _, filter_name = key.partition(",")
                if metric in _NOT_SCORES or metric.endswith("_stderr") or not isinstance(value, int | float):
                    continue
                name = f"{task}/{metric}" + (f"/{filter_name}" if filter_name not in ("", "none") else "")
                scores[name] = float(value)
    return scores
