"""litsft/training/step.py: one optimizer step. The loss weighs every target token the same whatever the micro-batch
it falls in, the token counts it returns, epochs rolling over to fill a step, skipped-step accounting, loss
scaling under 16-mixed, and what a step makes the host wait for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision

from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.network.batch import model_inputs
from litsft.model.network.context_parallel import ContextShard
from litsft.model.network.transformer import Transformer
from litsft.training.args import OptimizerConfig
from litsft.training.optimizer import build_optimizer
from litsft.training.step import (
    diverged,
    dropout_samples_of,
    next_micro_batches,
    raise_if_diverged,
    train_step,
)

VOCAB = 512


def micro_batch(rows: int, length: int, targets: int, seed: int) -> dict[str, torch.Tensor]:
    """`rows` x `length` tokens of which the first `targets` of each row carry a loss."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (rows, length), generator=generator)
    labels[:, targets:] = -100
    return {"input_ids": torch.randint(0, VOCAB, (rows, length), generator=generator), "labels": labels}


def setup(lr: float = 0.0) -> tuple[Fabric, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    model = Transformer(Config.from_name("tiny-llama"))
    return fabric, *fabric.setup(model, build_optimizer(model, OptimizerConfig(lr=lr or 1e-9)))


def reference_loss_and_grads(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]):
    """Mean cross-entropy over every target token of every batch, from the logits, and its gradients."""
    model.zero_grad()
    summed = sum(
        F.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten(), reduction="sum")
        for b in batches
    )
    tokens = sum(int((b["labels"] != -100).sum()) for b in batches)
    (summed / tokens).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return (summed / tokens).item(), grads


def test_the_loss_weighs_each_target_token_the_same_across_micro_batches() -> None:
    """Two micro-batches with 2 and 12 target tokens a row: the step's loss and gradients are those of the mean
    over all 28 tokens, not the mean of the two micro-batches' means."""
    fabric, model, optimizer = setup()
    batches = [micro_batch(2, 16, targets=2, seed=1), micro_batch(2, 16, targets=12, seed=2)]
    expected_loss, expected_grads = reference_loss_and_grads(model, batches)
    captured: dict[str, torch.Tensor] = {}  # each parameter's gradient, summed over the backward passes
    for name, param in model.named_parameters():
        param.register_hook(lambda grad, name=name: captured.__setitem__(name, captured.get(name, 0) + grad))
    loss, grad_norm, target_tokens, input_tokens = train_step(
        fabric, model, optimizer, batches, max_norm=None
    )
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert (int(target_tokens), int(input_tokens)) == (2 * 2 + 2 * 12, 2 * 2 * 16)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(captured[name], grad, rtol=1e-4, atol=1e-6)
    expected_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in expected_grads.values()]))
    assert grad_norm.item() == pytest.approx(expected_norm.item(), rel=1e-4)
    # Equal weighting would give another loss: the test can tell the two apart.
    means = [reference_loss_and_grads(model, [b])[0] for b in batches]
    assert abs(sum(means) / 2 - expected_loss) > 1e-3


def test_padding_is_not_counted_as_input_tokens() -> None:
    fabric, model, optimizer = setup()
    batch = micro_batch(2, 16, targets=5, seed=3)
    batch["document_ids"] = torch.zeros(2, 16, dtype=torch.long)
    batch["document_ids"][1, 10:] = -1  # the end of the second row is padding
    _, _, target_tokens, input_tokens = train_step(fabric, model, optimizer, [batch], max_norm=1.0)
    assert (int(target_tokens), int(input_tokens)) == (10, 32 - 6)


def test_unpacked_rows_count_their_real_tokens_not_their_padding() -> None:
    """An unpacked micro-batch is padded to its longest sample: samples of 9 and 30 tokens give 8 + 29 input
    tokens, not 2 x 29 (the padding a tokens/s figure must not count)."""
    from test_data_loader import random_samples

    from litsft.data.loader import collate

    fabric, model, optimizer = setup()
    batch = collate(random_samples([9, 30]), [[0], [1]], seq_length=None, pad_id=0)
    assert batch["input_ids"].shape == (2, 29)
    _, _, _, input_tokens = train_step(fabric, model, optimizer, [batch], max_norm=1.0)
    assert int(input_tokens) == 8 + 29


def test_the_routing_tally_sums_each_layers_expert_load_over_micro_batches_leaving_the_padding_out() -> None:
    """A mixture of experts over two unpacked micro-batches (samples of 9 and 30 tokens, then 5 and 12, the
    collate's padding to the longest): every layer's experts received k assignments per real input token of
    the step, 8 + 29 + 4 + 11, none for the padding (2 x 29 + 2 x 11 tokens in all)."""
    from launch import TINY_MOE
    from test_data_loader import random_samples

    from litsft.data.loader import collate
    from litsft.training.step import RoutingTally

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    config = Config.from_name("tiny-llama", **TINY_MOE)
    model = Transformer(config)
    model, optimizer = fabric.setup(model, build_optimizer(model, OptimizerConfig(lr=1e-9)))
    batches = [
        collate(random_samples(lengths), [[0], [1]], seq_length=None, pad_id=0)
        for lengths in ([9, 30], [5, 12])
    ]
    routing = RoutingTally()
    _, _, target_tokens, _ = train_step(fabric, model, optimizer, batches, max_norm=1.0, routing=routing)
    logged = routing.metrics(fabric, target_tokens)
    assert set(logged) == {"router_aux_loss", "expert_tokens"}
    expected = torch.full((config.num_layers,), float(config.experts_per_token * (8 + 29 + 4 + 11)))
    assert torch.equal(logged["expert_tokens"].sum(-1), expected)
    assert logged["expert_tokens"].shape == (config.num_layers, config.num_experts)


def test_balancing_biases_even_out_a_skewed_routing_over_steps() -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, the optimizer kept from moving anything (lr 1e-9): routers
    drawn wide, towards a direction every token shares, route unevenly; without biases the worst layer's load
    (busiest expert over the mean) stays where it starts, with --train.router_bias_update_rate 0.02 it falls."""
    from launch import TINY_MOE

    from litsft.training.metrics import expert_balance
    from litsft.training.step import RoutingTally

    def worst_loads(rate: float) -> list[float]:
        torch.manual_seed(0)
        fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
        model = Transformer(Config.from_name("tiny-llama", **TINY_MOE, router_bias_update_rate=rate))
        model.init_weights(0)
        with torch.no_grad():
            shared = F.normalize(torch.randn(model.config.hidden_size), dim=0)
            model.embed.weight += 0.1 * shared
            for block in model.blocks:
                block.mlp.router.weight.normal_(std=0.3)
                block.mlp.router.weight[0] += 0.5 * shared
        model, optimizer = fabric.setup(model, build_optimizer(model, OptimizerConfig(lr=1e-9)))
        loads = []
        for step in range(20):
            routing = RoutingTally()
            batch = micro_batch(2, 32, targets=32, seed=step)
            train_step(fabric, model, optimizer, [batch], max_norm=1.0, routing=routing)
            expert_tokens = routing.metrics(fabric, torch.tensor(1))["expert_tokens"]
            loads.append(expert_balance(expert_tokens)[:, 0].max().item())
        return loads

    off, on = worst_loads(0.0), worst_loads(0.02)
    assert off[0] == on[0] > 1.5  # the same routing before the first update
    assert sum(off[-5:]) / 5 > 1.55 and sum(on[-5:]) / 5 < 1.45, (off, on)


def test_the_reported_norm_is_the_one_before_clipping() -> None:
    fabric, model, optimizer = setup(lr=1e-3)
    batch = micro_batch(2, 16, targets=16, seed=4)
    _, unclipped, _, _ = train_step(fabric, model, optimizer, [batch], max_norm=None)
    fabric, model, optimizer = setup(lr=1e-3)
    _, reported, _, _ = train_step(fabric, model, optimizer, [batch], max_norm=1e-3)
    assert reported.item() == pytest.approx(unclipped.item(), rel=1e-5) and reported.item() > 1e-3


def test_after_update_runs_once_after_the_optimizer_step_and_before_the_gradients_go() -> None:
    """float8's scales are computed from the updated weights (`after_update`); the gradients still exist then."""
    fabric, model, optimizer = setup(lr=1e-3)
    before = model.lm_head.weight.detach().clone()
    seen = []

    def after_update() -> None:
        weight = model.lm_head.weight
        seen.append((not torch.equal(weight.detach(), before), weight.grad is not None))

    train_step(
        fabric, model, optimizer, [micro_batch(2, 16, targets=16, seed=4)], 1.0, after_update=after_update
    )
    assert seen == [(True, True)]
    assert model.lm_head.weight.grad is None  # then zeroed, as every step


class Loader:
    """An epoch of `size` numbered batches; `set_epoch` records the epochs it was asked for."""

    def __init__(self, size: int) -> None:
        self.size, self.epochs = size, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(self.size))


def test_micro_batches_fill_a_step_and_roll_over_into_the_next_epoch() -> None:
    loader = Loader(5)
    batches = iter(loader)
    first, epoch, batches = next_micro_batches(batches, loader, epoch=0, accumulation=2)
    second, epoch, batches = next_micro_batches(batches, loader, epoch, accumulation=2)
    assert (first, second, epoch, loader.epochs) == ([0, 1], [2, 3], 0, [])
    # One batch is left: it cannot fill a step, so the step is the next epoch's first two batches.
    third, epoch, batches = next_micro_batches(batches, loader, epoch, accumulation=2)
    assert (third, epoch, loader.epochs) == ([0, 1], 1, [1])


def test_a_loader_too_short_for_one_step_gives_none() -> None:
    loader = Loader(1)
    assert next_micro_batches(iter(loader), loader, epoch=0, accumulation=2)[0] is None


def test_skipped_steps_stop_the_run_with_their_count() -> None:
    raise_if_diverged(torch.tensor(0), step=10)
    with pytest.raises(LitsftError, match="inf or NaN in 3 of the first 10 steps"):
        raise_if_diverged(torch.tensor(3), step=10)


def _one_step(
    scaler: torch.amp.GradScaler | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad norm, parameter update, diverged) of one train_step of a tiny model, clipped to norm 1.0,
    in fp32 or, with `scaler`, under fp16 autocast with that loss scaler (Fabric's 16-mixed, on the CPU)."""
    torch.manual_seed(0)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)] if scaler is not None else None
    fabric = Fabric(accelerator="cpu", devices=1, plugins=plugins)
    model = Transformer(Config.from_name("tiny-llama"))
    model, optimizer = fabric.setup(model, build_optimizer(model, OptimizerConfig(lr=1e-3)))
    before = [param.detach().clone() for param in model.parameters()]
    generator = torch.Generator().manual_seed(1)
    batch = {name: torch.randint(0, 512, (2, 32), generator=generator) for name in ("input_ids", "labels")}
    loss, grad_norm, _, _ = train_step(fabric, model, optimizer, [batch], max_norm=1.0)
    update = torch.cat([(param.detach() - old).flatten() for param, old in zip(model.parameters(), before)])
    return loss, grad_norm, update, diverged(fabric, loss, grad_norm)


def test_16_mixed_clips_and_reports_the_unscaled_gradients():
    """Under 16-mixed the gradients are unscaled before clipping: the reported norm and the update are those
    of fp32 training, not those of gradients 2**16 times too large clipped to max_norm (which reported a norm
    of 71,597 and shrank this update to half)."""
    _, fp32_norm, fp32_update, _ = _one_step(None)
    scaler = torch.amp.GradScaler("cpu")
    _, fp16_norm, fp16_update, fp16_diverged = _one_step(scaler)
    assert fp32_norm > 1.0  # clipping is active
    torch.testing.assert_close(fp16_norm, fp32_norm, rtol=1e-2, atol=0)
    # fp16 matmuls change the gradients a little (measured: 2.7% of the update's norm)
    assert (fp16_update - fp32_update).norm() < 0.1 * fp32_update.norm()
    assert not fp16_diverged
    assert scaler.get_scale() == 2.0**16  # no overflow: the scale stays


def test_16_mixed_overflow_skips_the_update_and_lowers_the_scale_without_counting_as_divergence():
    """Scaled gradients that overflow fp16 are how the scaler finds its scale: the update is skipped and the
    scale halved, and the run is not stopped as diverged."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    loss, grad_norm, update, step_diverged = _one_step(scaler)
    assert torch.isfinite(loss) and not torch.isfinite(grad_norm)
    assert torch.count_nonzero(update) == 0
    assert scaler.get_scale() == 2.0**39
    assert not step_diverged
    poisoned = torch.tensor(float("nan"))
    assert diverged(Fabric(accelerator="cpu", devices=1), loss, poisoned)  # without a scaler it is divergence


class _Loader:
    """A fixed list of micro-batches with the loader interface the loop uses."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        pass


def _packed_micro_batch(seed: int) -> dict[str, torch.Tensor]:
    """One packed row of 24 positions: documents of 9, 3 and 8 tokens, then 4 of padding."""
    from litsft.model.network.attention import cumulative_lengths

    generator = torch.Generator().manual_seed(seed)
    lengths = [9, 3, 8]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((4,), -1)])
    labels = torch.randint(0, 512, (1, 24), generator=generator)
    labels[:, 20:] = -100
    return {
        "input_ids": torch.randint(0, 512, (1, 24), generator=generator),
        "labels": labels,
        "position_ids": torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(4, dtype=torch.long)])[
            None
        ],
        "document_ids": document_ids[None],
        "cu_seqlens": cumulative_lengths(lengths),
        "max_seqlen": torch.tensor(max(lengths)),
    }


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available(),
                    reason="CUDA's own sync checker needs a GPU; the CPU run counts calls",
                ),
            ],
        ),
    ],
)
def test_steps_that_log_nothing_make_the_host_wait_for_nothing(tmp_path, monkeypatch, device):
    """Three optimizer steps of the loop (two micro-batches each, packed rows, clipping), logging at the
    third only. Steps 1 and 2 make no device synchronization, read no tensor on the host and create no
    device tensor from host values (on a GPU each of these makes the host wait); the host reads only what it
    built itself, the micro-batches it prepares before anything is on the device. The logging step does
    synchronize and read, which shows that the counting sees them. On the CPU every call is counted as it
    would be made on a GPU: `_synchronize` whatever the device, each `torch.tensor(..., device=...)`, each
    `.to(device)` in litsft without non_blocking. On a GPU, CUDA's sync debug mode also raises on any
    synchronizing call during steps 1 and 2 (torch.cuda.set_sync_debug_mode)."""
    import sys

    from torch.overrides import TorchFunctionMode

    import litsft.training.engine
    import litsft.training.metrics
    import litsft.training.step
    from litsft.training.args import RunConfig, TrainConfig
    from litsft.training.checkpointer import TrainState
    from litsft.training.engine import train_loop
    from litsft.training.metrics import MetricsLogger

    events: list[str] = []
    on_host = [False]  # inside the host's own batch preparation

    def count(kind: str, function):
        def counted(*args, **kwargs):
            if not on_host[0]:
                events.append(kind)
            return function(*args, **kwargs)

        return counted

    def host_side(function):
        def preparing(*args, **kwargs):
            on_host[0] = True
            try:
                return function(*args, **kwargs)
            finally:
                on_host[0] = False

        return preparing

    class HostWaits(TorchFunctionMode):
        """Sees every torch call (torch itself is not patched: torch caches some of its own functions)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if on_host[0]:
                pass
            elif name in ("item", "tolist", "__bool__", "__int__", "__float__"):
                events.append(f"host read ({name})")
            elif func is torch.tensor and kwargs.get("device") is not None:
                events.append("tensor created on the device from host values")
            elif name == "to" and not kwargs.get("non_blocking", False):
                to_a_device = any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs
                if to_a_device and sys._getframe(1).f_globals.get("__name__", "").startswith("litsft"):
                    events.append("blocking copy")
            return func(*args, **kwargs)

    monkeypatch.setattr(
        litsft.training.metrics, "_synchronize", count("synchronize", litsft.training.metrics._synchronize)
    )
    monkeypatch.setattr(torch.cuda, "synchronize", count("synchronize", torch.cuda.synchronize))
    monkeypatch.setattr(litsft.training.step, "model_inputs", host_side(litsft.training.step.model_inputs))
    monkeypatch.setattr(litsft.training.step, "row_lengths", host_side(litsft.training.step.row_lengths))
    train_step = count("--- step ---", litsft.training.engine.train_step)

    def step_checked_by_cuda(*args, **kwargs):
        # Steps 1 and 2, and what the loop does after them up to the next step, under CUDA's checker.
        torch.cuda.set_sync_debug_mode("error" if events.count("--- step ---") < 2 else "default")
        return train_step(*args, **kwargs)

    monkeypatch.setattr(
        litsft.training.engine, "train_step", step_checked_by_cuda if device == "cuda" else train_step
    )

    torch.manual_seed(0)
    config = Config.from_name("tiny-llama")
    fabric = Fabric(accelerator=device, devices=1, precision="32-true")
    model = Transformer(config)
    model.attention_kernel = "mask"  # the CPU's own kernel plans documents on the host, by design
    model, optimizer = fabric.setup(model, build_optimizer(model, OptimizerConfig(lr=1e-3)))
    loader = _Loader([_packed_micro_batch(seed) for seed in range(6)])
    state = TrainState(model, optimizer, loader, skipped_steps=torch.zeros((), device=fabric.device))
    run = RunConfig(
        config=config, tokenizer_dir=None, data=None, out_dir=tmp_path, precision="32-true",
        train=TrainConfig(global_batch_size=2, micro_batch_size=1, max_steps=3, log_interval=3, max_norm=1.0),
    )  # fmt: skip
    metrics = MetricsLogger(tmp_path, is_global_zero=True, total_steps=3)
    metrics.set_model(config, world_size=1, device=fabric.device, precision="32-true")
    try:
        with metrics, HostWaits():
            train_loop(fabric, run, state, metrics, checkpointer=None, evaluate=lambda step: None)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")

    steps = " ".join(events).split("--- step ---")[1:]
    assert len(steps) == 3
    assert steps[0].strip() == steps[1].strip() == "", events
    assert "synchronize" in steps[2] and "host read" in steps[2]


def test_a_context_ranks_dropout_samples_are_those_of_the_rows_its_group_splits() -> None:
    """Unpacked rows, the first shorter than the second: split_for_context lays them out whole (each a document
    of the padded width, 7 tokens) in one row of 14, so the second sample starts at token 7, not after the
    first's 3 real tokens; rank 1 of 2 holds tokens 7 to 14."""
    batch = {
        "input_ids": torch.ones(2, 7, dtype=torch.long),
        "labels": torch.ones(2, 7, dtype=torch.long),
        "row_lengths": torch.tensor([3, 7]),
    }
    (samples,) = dropout_samples_of([batch], [model_inputs(batch)], 0, 3, 1, ContextShard(None, 1, 2))
    assert (samples.starts, samples.lengths, samples.tokens, samples.local) == ((0, 7), (3, 7), 14, (7, 14))
