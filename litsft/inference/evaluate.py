"""`litsft evaluate`: lm-evaluation-harness benchmarks run on litsft's own model.

Whatever litsft reads (a checkpoint, a training run's final/ with its LoRA adapters, a Hugging Face folder or
hub id) is scored as it is, with no export to Hugging Face format first: `LitsftLM` is an lm_eval `TemplateLM`
over a litsft `Transformer` and `Tokenizer`. Each request is handled the way lm_eval's own `hf` model (HFLM)
handles it (the same tokens in, the same truncation, stop strings and chat rendering), so that a checkpoint
scores what its Hugging Face export scores under `lm_eval --model hf`.

lm_eval is an optional dependency (`pip install 'litsft[eval]'`): without it this module still imports, and
`evaluate` refuses in one line.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tqdm import tqdm

from litsft.errors import LitsftError, check_number

try:
    from lm_eval.api.model import TemplateLM
except ImportError:  # `evaluate` refuses before anything uses the class
    TemplateLM = object

if TYPE_CHECKING:
    import torch
    from lightning.fabric import Fabric
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager

    from litsft.data.tokenizer import Tokenizer
    from litsft.inference.generate import StopText
    from litsft.inference.lockstep import Lockstep
    from litsft.model.network.transformer import Transformer

Dtype = Literal["float32", "bfloat16", "float16"]  # generate.Dtype, whose module imports torch

# What transformers' apply_chat_template(continue_final_message=True) appends to the last message, to find
# where that message ends in the rendered text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_SAMPLING_KWARGS = ("temperature", "top_k", "top_p")


class LitsftLM(TemplateLM):
    """lm_eval's model interface over a litsft model: log-likelihoods from its logits, greedy generation with
    its KV cache, prompts through its own chat template.

    Args:
        model: A litsft `Transformer` in eval mode.
        tokenizer: Its tokenizer.
        name: What the model was opened from (names the request cache and the results).
        batch_size: Sequences per forward pass.
        rank: This process's place among `processes` that each score a share of every request type's
            requests (torch.distributed's default group); all of them get every result.
        processes: Processes evaluating together.
        lockstep: Given when the model is sharded over those processes: their forward passes must match.
        progress: Show progress bars (on rank 0).
    """

    MAX_GEN_TOKS = 256  # HFLM's default for tasks that set no max_gen_toks

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        name: str,
        batch_size: int = 1,
        rank: int = 0,
        processes: int = 1,
        lockstep: Lockstep | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__()
        self.model, self.tokenizer, self.name, self.batch_size = model, tokenizer, name, batch_size
        # Not lm_eval's rank and world size, which would deal documents (and few-shot draws) to processes.
        self._share_rank, self._shares, self._lockstep = rank, processes, lockstep
        self._progress = progress and rank == 0
        # The text of the token HFLM prepends to an empty context; a prompt that starts with it (a chat
        # template that writes bos) gets no second one.
        self._prefix_text = tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        # HFLM's: bos, or eos for tokenizers without one (Qwen).
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self.model.config.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def tokenizer_name(self) -> str:
        return self.name.replace("/", "__")

    def _scored_in_shares(self, items: list[Any], score: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """`score(items)`, each of the processes scoring every `processes`-th item from its rank; every
        process gets all the results, in the order of `items`. lm_eval builds every request on every
        process (so few-shot examples are drawn as in one process) and computes the metrics on each."""
        if self._shares == 1:
            results = score(items)
            self._forward_passes_done()
            return results
        import torch.distributed as dist

        mine = score(items[self._share_rank :: self._shares])
        self._forward_passes_done()
        shares: list[Any] = [None] * self._shares
        dist.all_gather_object(shares, mine)
        results: list[Any] = [None] * len(items)
        for rank, share in enumerate(shares):
            results[rank :: self._shares] = share
        return results

    def _forward_passes_done(self) -> None:
        """Under sharding, this process takes part in the other processes' remaining forward passes
        (`Lockstep.finish`)."""
        if self._lockstep is not None:
            self._lockstep.finish()

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # As HFLM: the tokenizer's own special tokens (bos for Llama, none for Qwen) unless told otherwise, or
        # unless the text already starts with the prefix token.
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self._prefix_text)
        return self.tokenizer.encode(string, add_bos=add_special_tokens and self.tokenizer.add_bos)

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether greedy decoding would produce it) per request of
        (strings, context ids, continuation ids)."""
        score = functools.partial(self._score_continuations, progress=self._progress and not disable_tqdm)
        return self._scored_in_shares(requests, score)

    def _score_continuations(
        self, requests: list[tuple[Any, list[int], list[int]]], progress: bool
    ) -> list[tuple[float, bool]]:
        import torch
        from lm_eval.models.utils import Collator

        # HFLM's batching: longest first, and the requests that share context + continuation[:-1] (multiple
        # choice over one-token answers) scored from one row.
        collator = Collator(
            requests,
            sort_fn=lambda request: (-len(request[1]) - len(request[2]), tuple(request[1] + request[2])),
            group_by="contexts",
            group_fn=lambda request: request[1] + request[2][:-1],
        )
        results = []
        batches = collator.get_batched(n=self.batch_size)
        for batch in tqdm(batches, desc="loglikelihood batches", disable=not progress):
            # The model sees at most max_length tokens, the last one only predicted: longer rows lose their
            # start, as in HFLM. Rows are right-padded; causal attention keeps padding out of what is scored.
            rows = [
                (context + continuation)[-(self.max_length + 1) :][:-1] for _, context, continuation in batch
            ]
            tokens = torch.full((len(rows), max(map(len, rows))), self.tokenizer.pad_id, device=self.device)
            for i, row in enumerate(rows):
                tokens[i, : len(row)] = torch.tensor(row)
            with torch.no_grad():
                logits = self.model(tokens)  # (B, T, V)
            for (strings, context, longest), row_logits, row in zip(batch, logits, rows):
                # The positions that predict the continuation (the longest of its group), in float32.
                predicting = row_logits[len(row) - len(longest) : len(row)].float().log_softmax(dim=-1)
                for _, continuation, logprobs in collator.get_cache(
                    req_str=strings, cxt_toks=context, cont_toks=longest, logits=predicting[None]
                ):
                    target = torch.tensor(continuation, device=self.device)
                    scored = logprobs[0, -len(continuation) :]  # (C, V); a shorter continuation: the tail
                    logprob = scored.gather(-1, target[:, None]).sum().item()
                    results.append((logprob, bool((scored.argmax(dim=-1) == target).all())))
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """The log-probability of each whole text, as HFLM scores it: in disjoint windows of max_length
        tokens, each token predicted once, the first one from the prefix token."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            pairs = get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1
            )
            for context, continuation in map(make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each prompt's continuation, cut at the first of its stop strings, as HFLM returns it."""
        generate = functools.partial(self._generate, progress=self._progress and not disable_tqdm)
        return self._scored_in_shares([request.args for request in requests], generate)

    def _generate(self, requests: list[tuple[str, dict[str, Any]]], progress: bool) -> list[str]:
        from lm_eval.models.utils import (
            Collator,
            handle_stop_sequences,
            normalize_gen_kwargs,
            postprocess_generated_text,
        )

        from litsft.inference.generate import generate_batch

        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        # One group per set of generation settings (tasks differ in stop strings and lengths).
        collator = Collator(requests, sort_fn=lambda args: len(args[0]), group_by="gen_kwargs")
        results = []
        for group in collator.get_batched(n=0):
            contexts, all_kwargs = zip(*group)
            kwargs = dict(normalize_gen_kwargs(all_kwargs[0], self.MAX_GEN_TOKS))
            until = handle_stop_sequences(kwargs.pop("until"), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            if max_new >= self.max_length:
                raise LitsftError(
                    f"a task asks for max_gen_toks={max_new} but the model holds {self.max_length} tokens; "
                    "lower the task's max_gen_toks"
                )
            # As HFLM: the prompt keeps its last max_length - max_gen_toks tokens.
            prompts = [self.tok_encode(context)[-(self.max_length - max_new) :] for context in contexts]
            sample = kwargs.pop("do_sample")
            outputs = []
            # One batch at a time, for the progress bar: the prompts come sorted by length.
            for start in tqdm(
                range(0, len(prompts), self.batch_size), desc="generation", disable=not progress
            ):
                batch = prompts[start : start + self.batch_size]
                if sample:
                    outputs += self._sample(batch, max_new, kwargs)
                else:
                    # Greedy; a row ends at a stop id or once a stop string appears, and its text is cut at
                    # the string below, as HFLM does.
                    outputs += generate_batch(
                        self.model, batch, max_new, self.tokenizer.stop_ids, stop_text=self._stop_text(until)
                    )
            ignored = sorted(set(kwargs) - set(_SAMPLING_KWARGS))
            if ignored and self._share_rank == 0:
                print(f"note: litsft evaluate ignores the generation settings {ignored}", file=sys.stderr)
            results += [
                postprocess_generated_text(self.tokenizer.decode(output), until, think_end_token=None)
                for output in outputs
            ]
        return collator.get_original(results)

    def _stop_text(self, until: list[str]) -> StopText | None:
        """A task's stop strings, checked on each row's newest tokens: a few more than the longest string
        takes (a token may hold several characters, or a string start in the middle of one)."""
        from litsft.inference.generate import StopText

        strings = [string for string in until if string]
        if not strings:
            return None
        longest = max(len(self.tokenizer.encode(string, add_bos=False)) for string in strings)
        return StopText(strings, self.tokenizer.decode, window=longest + 2)

    def _sample(self, prompts: list[list[int]], max_new: int, kwargs: dict[str, Any]) -> list[list[int]]:
        import torch

        from litsft.inference.generate import generate_tokens

        return [
            generate_tokens(
                self.model,
                torch.tensor(prompt),
                max_new,
                temperature=kwargs.get("temperature", 1.0),
                top_k=kwargs.get("top_k"),
                top_p=kwargs.get("top_p", 1.0),
                stop_ids=self.tokenizer.stop_ids,
            ).tolist()
            for prompt in prompts
        ]

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation through the model's chat template, as HFLM renders it with transformers."""
        try:
            return self._render(chat_history, add_generation_prompt)
        except LitsftError:  # as HFLM: some templates refuse a system message; try without it
            without_system = [message for message in chat_history if message["role"] != "system"]
            return self._render(without_system, add_generation_prompt)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if add_generation_prompt:
            return self.tokenizer.render_chat(messages, add_generation_prompt=True)
        # lm_eval asks for no generation prompt when a task starts the reply itself (gen_prefix): HFLM then
        # renders with transformers' continue_final_message, and the text ends where that reply does.
        *earlier, last = messages
        text = self.tokenizer.render_chat([*earlier, {**last, "content": last["content"] + _CONTINUE_TAG}])
        end = text.rfind(_CONTINUE_TAG.strip())
        if end < 0:
            raise LitsftError(
                f"the chat template of {self.name} drops the reply a task starts (gen_prefix); "
                "run without --apply_chat_template"
            )
        # The tag with its trailing space intact: the template kept the message's spacing.
        return text[:end] if text.startswith(_CONTINUE_TAG, end) else text[:end].rstrip()

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template else None

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(next(self.model.parameters()).dtype),
        }


def find_tasks(tasks: str | None, include_path: str | None) -> tuple[TaskManager, list[str]]:
    """lm_eval's task index and the task names that `tasks` (comma-separated names or glob patterns) match;
    a name that matches none is refused in one line. Checks that lm_eval is installed."""
    try:
        import lm_eval  # noqa: F401  (first: a loaded lm_eval.tasks would be found without its package)
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise LitsftError(
            "the tasks run in lm-evaluation-harness, which is not installed: pip install 'litsft[eval]'"
        ) from None
    names = [name.strip() for name in (tasks or "").split(",") if name.strip()]
    if not names:
        raise LitsftError("name the tasks to run, e.g. --tasks hellaswag,arc_easy")
    if include_path is not None and not Path(include_path).is_dir():
        raise LitsftError(f"--include_path {include_path} is not a folder of task YAML files")
    # Indexing lm_eval's own ~14,000 task files takes seconds (17 s on a busy 2-core machine): tasks that
    # are all in include_path are found without them.
    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(local.match_tasks([name]) for name in names):
            return local, local.match_tasks(names)
    task_manager = TaskManager(include_path=include_path)
    unknown = [name for name in names if not task_manager.match_tasks([name])]
    if unknown:
        raise LitsftError(
            f"unknown lm_eval tasks: {', '.join(unknown)}; `lm_eval ls tasks` lists them, and --include_path "
            "adds your own"
        )
    return task_manager, task_manager.match_tasks(names)


def load_tasks(task_manager: TaskManager, tasks: list[str], option: str) -> None:
    """Load each task's documents once (downloaded into the datasets cache, which later loads read): a task
    that cannot load is refused in one line (naming `option`, the flag that asked for it) before a model is
    read or a run starts, not with lm_eval's traceback when it is first scored."""
    import datasets
    from lm_eval.tasks import get_task_dict

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a refusal that follows is one line
    try:
        get_task_dict(tasks, task_manager)
    except Exception as err:  # what a dataset fails with varies: missing files, the hub, the network
        reason = next(iter(str(err).splitlines()), "")
        raise LitsftError(
            f"{option}: lm_eval could not load {', '.join(tasks)} ({type(err).__name__}: {reason}); fix the "
            "task or its dataset, or leave it out"
        ) from None
    finally:
        if bars:
            datasets.enable_progress_bars()


def check_chat_template(model_dir: Path, apply_chat_template: bool, option: str, name: str) -> None:
    """Prompts rendered through the chat template (`option`, the flag that asks for it) need one in the
    tokenizer of `model_dir` (the model the user named `name`)."""
    from litsft.data.tokenizer import Tokenizer

    if apply_chat_template and Tokenizer(model_dir).chat_template is None:
        raise LitsftError(f"{name} has no chat template; run without {option}")


def run_tasks(
    lm: LitsftLM,
    task_manager: TaskManager,
    tasks: list[str],
    *,
    num_fewshot: int | None,
    limit: int | float | None,
    apply_chat_template: bool,
    fewshot_as_multiturn: bool,
    confirm_run_unsafe_code: bool,
    log_samples: bool = False,
    bootstrap_iters: int = 100_000,
) -> dict[str, Any]:
    """lm_eval's results (its JSON) of `tasks` scored by `lm`, on every process `lm` shares the work with."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=lm,
        model_args=lm.name,
        tasks=tasks,
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=lm.batch_size,
        apply_chat_template=apply_chat_template,
        fewshot_as_multiturn=fewshot_as_multiturn,
        confirm_run_unsafe_code=confirm_run_unsafe_code,
        log_samples=log_samples,
        bootstrap_iters=bootstrap_iters,
        task_manager=task_manager,
    )


def evaluate(
    checkpoint_dir: str,  # not Path, which would drop the ./ that marks a local directory
    tasks: str | None = None,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int = 8,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool = True,
    include_path: str | None = None,
    confirm_run_unsafe_code: bool = False,
    out_dir: Path = Path("out/evaluate"),
    log_samples: bool = False,
    dtype: Dtype | None = None,
    devices: int = 1,
) -> None:
    """Score a model on lm-evaluation-harness tasks; write and print the results.

    Args:
        checkpoint_dir: The model: a litsft checkpoint directory (a training run's out_dir/final, with its
            LoRA adapters applied for a finetune_lora run), a Hugging Face model directory or a hub id.
        tasks: lm_eval task or group names, comma-separated (glob patterns allowed), e.g. hellaswag,arc_easy.
        num_fewshot: Examples in each prompt. Default: each task's own.
        limit: Score only this many documents of each task (a fraction of them when below 1).
        batch_size: Sequences per forward pass.
        apply_chat_template: Render prompts through the checkpoint's chat template, for chat models.
        fewshot_as_multiturn: With the chat template, give each few-shot example as a turn of its own
            conversation (as lm_eval does by default).
        include_path: A folder of your own task YAML files, found by their names like lm_eval's tasks.
        confirm_run_unsafe_code: Allow tasks that execute the code the model writes (humaneval, mbpp; they
            also need the environment variable HF_ALLOW_CODE_EVAL=1).
        out_dir: Where results.json goes (and samples_<task>.jsonl with log_samples); an existing
            results.json is never overwritten.
        log_samples: Also write every request and response of each task.
        dtype: Weights and compute dtype. Default: bfloat16 on a GPU that supports it, else float32.
        devices: Processes, each with its own copy of the model (one per GPU, or CPU processes on a machine
            without one), each scoring a slice of every task's requests; the results are gathered.
    """
    check_number("batch_size", batch_size, at_least=1)
    check_number("devices", devices, at_least=1)
    results_file = out_dir / "results.json"
    if results_file.exists():
        raise LitsftError(f"{results_file} exists already; choose another --out_dir")
    task_manager, names = find_tasks(tasks, include_path)
    load_tasks(task_manager, names, "--tasks")
    import torch
    from lightning.fabric import Fabric

    from litsft.inference.generate import model_directory

    # Downloaded and converted here, before the processes start: they would otherwise race to do it.
    local_dir = str(model_directory(checkpoint_dir))
    check_chat_template(Path(local_dir), apply_chat_template, "--apply_chat_template", checkpoint_dir)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and devices > gpus:
        raise LitsftError(
            f"--devices {devices} asks for {devices} GPUs but this machine has {gpus}; pass --devices {gpus}"
        )
    fabric = Fabric(
        accelerator="cuda" if gpus else "cpu", devices=devices, strategy="ddp" if devices > 1 else "auto"
    )
    options = dict(
        num_fewshot=num_fewshot,
        limit=limit,
        apply_chat_template=apply_chat_template,
        fewshot_as_multiturn=fewshot_as_multiturn,
        confirm_run_unsafe_code=confirm_run_unsafe_code,
        log_samples=log_samples,
    )
    fabric.launch(
        _evaluate_on_rank, checkpoint_dir, local_dir, dtype, batch_size, task_manager, names, options, out_dir
    )


def _evaluate_on_rank(
    fabric: Fabric,
    checkpoint_dir: str,
    local_dir: str,
    dtype: Dtype | None,
    batch_size: int,
    task_manager: TaskManager,
    tasks: list[str],
    options: dict[str, Any],
    out_dir: Path,
) -> None:
    from lm_eval.utils import handle_non_serializable, make_table

    from litsft.inference.generate import open_model

    model, tokenizer = open_model(local_dir, dtype, fabric.device)
    lm = LitsftLM(model, tokenizer, checkpoint_dir, batch_size, fabric.global_rank, fabric.world_size)
    results = run_tasks(lm, task_manager, tasks, **options)
    if not fabric.is_global_zero:  # every process has the results: the first writes them
        return
    samples = results.pop("samples", {})
    results_file = out_dir / "results.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    with results_file.open("x", encoding="utf-8") as file:  # "x": never over a file written meanwhile
        json.dump(results, file, indent=2, default=handle_non_serializable, ensure_ascii=False)
    for task, task_samples in samples.items():
        with (out_dir / f"samples_{task}.jsonl").open("x", encoding="utf-8") as file:
            for sample in task_samples:
                file.write(json.dumps(sample, default=handle_non_serializable, ensure_ascii=False) + "\n")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    print(f"results written to {results_file}", file=sys.stderr)
