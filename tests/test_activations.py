"""Activations in the memory estimate: measured bytes against a count by hand from the model's shapes.

Every figure here is exact: the fake forward must count what a real one does, byte for byte, and
both must agree with the shapes. One cuda-marked case compares the estimator's peak per rank with
CUDA's peak allocation in a real training run (tests/gpu_check.sh runs every cuda-marked test).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch

from common.models import GPT_PRESETS, GPTConfig
from tests.harness.runs import run_script
from tools.estimates import estimate_communication, estimate_memory
from tools.estimates.activations import FORWARDS, ActivationBytes, gpt_activations, mnist_activations
from tools.estimates.estimate_memory import GIB, MIB, estimate_model, forward_of, main
from tools.model_shapes import fine_tune, gpt_parameter_shapes

TINY = GPTConfig(vocab_size=16, **GPT_PRESETS["tiny"])
# Widths in bytes, by how a script computes: (the residual stream and the layer norms' inputs, what a
# matmul saves of its input, what matmuls and attention output, a layer norm's mean and rstd).
# Autocast casts each matmul's input to bf16 and keeps the residual sum and the norms in fp32; FSDP's
# bf16 parameters make everything bf16, the CPU's layer-norm statistics too (CUDA's stay fp32).
WIDTHS = {"fp32": (4, 4, 4, 4), "autocast": (4, 2, 2, 4), "param_dtype": (2, 2, 2, 2)}
LOGSUMEXP = 4  # fp32 per query and head, whatever the inputs' dtype
ID = 8  # int64 token ids, targets and positions


def block_by_hand(config: GPTConfig, batch: int, forward: str) -> int:
    """What one Block saves for backward, its input included. The attention kernel keeps no T x T scores."""
    residual, matmul_in, out, stat = WIDTHS[forward]
    d = config.d_model
    per_token = (
        residual * d + 2 * stat  # ln1: its input, mean and rstd
        + matmul_in * d  # qkv's input
        + 3 * out * d  # q, k and v, views of qkv's output, saved by attention
        + out * d + LOGSUMEXP * config.n_head  # attention's output (proj's input is a view of it)
        + residual * d + 2 * stat  # ln2
        + matmul_in * d  # fc's input
        + 2 * 4 * out * d  # GELU's input, and its output (proj's input)
    )  # fmt: skip
    return batch * config.block_size * per_token


def outside_by_hand(config: GPTConfig, batch: int, forward: str) -> int:
    """What stays outside the Blocks: ids, the final norm, the head's input, the logits and the fp32 loss."""
    residual, matmul_in, out, stat = WIDTHS[forward]
    tokens = batch * config.block_size
    ids = ID * (2 * tokens + config.block_size)  # inputs, targets, positions
    final = tokens * (residual * config.d_model + 2 * stat + matmul_in * config.d_model)
    logits = tokens * config.vocab_size * (out + 4)  # as the model returns them, and the fp32 log-softmax
    return ids + final + logits + 4  # the loss's total weight, an fp32 scalar


def real(config: GPTConfig, batch: int, *, checkpointing: bool, forward: str) -> ActivationBytes:
    """A real forward: at these sizes 10 times quicker than the fake one, which is checked to agree."""
    return gpt_activations(config, batch, checkpointing=checkpointing, forward=forward, fake=False)


def input_by_hand(config: GPTConfig, batch: int, forward: str) -> int:
    return batch * config.block_size * config.d_model * WIDTHS[forward][0]


@pytest.mark.parametrize("forward", FORWARDS)
def test_a_full_forward_keeps_what_the_shapes_say(forward: str) -> None:
    for config in (TINY, dataclasses.replace(TINY, n_layer=3, vocab_size=1000, d_model=96, n_head=3)):
        measured = real(config, 2, checkpointing=False, forward=forward)
        predicted = config.n_layer * block_by_hand(config, 2, forward) + outside_by_hand(config, 2, forward)
        assert (measured.kept, measured.recomputed) == (predicted, 0)
        # Autocast's bf16 copy of each matmul's weight (12 d x d a Block, and the head), saved for backward.
        matmul_weights = config.n_layer * 12 * config.d_model**2 + config.vocab_size * config.d_model
        assert measured.weight_copies == (2 * matmul_weights if forward == "autocast" else 0)


@pytest.mark.parametrize("forward", FORWARDS)
def test_checkpointing_keeps_each_block_input_and_recomputes_one_block(forward: str) -> None:
    config, batch = dataclasses.replace(TINY, n_layer=4), 3
    measured = real(config, batch, checkpointing=True, forward=forward)
    block_input = input_by_hand(config, batch, forward)
    assert measured.kept == config.n_layer * block_input + outside_by_hand(config, batch, forward)
    assert measured.recomputed == block_by_hand(config, batch, forward) - block_input
    assert measured.backward >= measured.recomputed  # the rebuilt Block lives in backward, beside gradients
    full = real(config, batch, checkpointing=False, forward=forward)
    assert measured.peak < full.kept / 2


def test_the_fake_forward_counts_what_a_real_one_does() -> None:
    for forward in FORWARDS:
        for checkpointing in (False, True):
            fake = gpt_activations(TINY, 2, checkpointing=checkpointing, forward=forward)
            assert fake == gpt_activations(TINY, 2, checkpointing=checkpointing, forward=forward, fake=False)
    assert mnist_activations(3) == mnist_activations(3, fake=False)


def test_fine_tuning_changes_what_a_step_holds_as_a_real_one_shows() -> None:
    """A frozen linear layer saves no input for a weight gradient it will not compute; a LoRA adapter saves
    its own. The estimators measure the model as the scripts change it (tools.model_shapes.fine_tune)."""
    plain = real(TINY, 2, checkpointing=False, forward="fp32")
    for changes in ({"freeze_patterns": ["blocks.0.*"]}, {"lora_rank": 4}):
        prepare = functools.partial(fine_tune, **changes)
        fake = gpt_activations(TINY, 2, checkpointing=False, forward="fp32", prepare=prepare)
        assert fake == gpt_activations(TINY, 2, checkpointing=False, forward="fp32", prepare=prepare, fake=False)
        assert fake.kept < plain.kept, changes


def test_mnist_keeps_what_its_shapes_say() -> None:
    """Per image: the input, two ReLU maps, max-pool's int64 indices, two dropout masks and outputs, the
    logits and the log-softmax. The CPU's dropout keeps an fp32 mask; CUDA's fused kernel keeps a bool."""
    fp32 = 4
    per_image = fp32 * (784 + 32 * 26 * 26 + 64 * 24 * 24) + ID * 9216 + 2 * fp32 * (9216 + 128)
    per_image += fp32 * 128 + 2 * fp32 * 10 + ID  # fc1's ReLU, the logits and log-softmax, the label
    assert mnist_activations(5, fake=False).kept == 5 * per_image + 4


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("forward", FORWARDS)
def test_bytes_grow_linearly_with_batch_and_block_size(forward: str, checkpointing: bool) -> None:
    """Exactly affine in the batch (the positions are shared by all sequences), and in the block size:
    no term grows as T x T, since the CPU's attention kernel (flash) keeps no scores."""

    def peak(batch: int, block: int) -> int:
        config = dataclasses.replace(TINY, block_size=block)
        measured = gpt_activations(
            config, batch, checkpointing=checkpointing, forward=forward, fake=False, backward=False
        )
        return measured.kept + measured.recomputed

    by_batch = [peak(batch, 64) for batch in (1, 2, 7)]
    per_sequence = by_batch[1] - by_batch[0]
    assert by_batch == [by_batch[0] + (batch - 1) * per_sequence for batch in (1, 2, 7)]
    by_block = [peak(2, block) for block in (32, 64, 224)]  # a T x T term would bend this line
    per_token = (by_block[1] - by_block[0]) / 32
    assert by_block == [by_block[0] + (block - 32) * per_token for block in (32, 64, 224)]


def test_bf16_halves_all_but_the_fp32_loss_ids_and_logsumexp() -> None:
    config, batch = TINY, 2
    fp32 = real(config, batch, checkpointing=False, forward="fp32").kept
    bf16 = real(config, batch, checkpointing=False, forward="param_dtype").kept
    tokens = batch * config.block_size
    stays = ID * (2 * tokens + config.block_size) + 4 + tokens * config.n_head * LOGSUMEXP * config.n_layer
    log_softmax, logits = 4 * tokens * config.vocab_size, 4 * tokens * config.vocab_size
    assert bf16 == (fp32 - stays - log_softmax - logits) / 2 + stays + log_softmax + logits / 2
    autocast = real(config, batch, checkpointing=False, forward="autocast").kept
    assert bf16 < autocast < fp32  # autocast keeps the residual stream and the norms in fp32


def table_rows(out: str) -> dict[str, dict[str, str]]:
    """Each strategy's row of the printed table, cell by column name."""
    lines = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    header, *rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines]
    return {row[1]: dict(zip(header, row, strict=True)) for row in rows}


def test_the_estimator_shows_activations_and_the_peak_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    batch = 512  # the small GPT's activations in GiB
    job = ["--world-size", "8", "--gpu-memory", "80", "--mixed-precision", "bf16"]
    main(["--model", "small", "--batch-size", str(batch), *job])
    rows = table_rows(capsys.readouterr().out)
    config = GPTConfig(vocab_size=16, **GPT_PRESETS["small"])
    for strategy in ("ddp", "full_shard"):
        activations = gpt_activations(
            config, batch, checkpointing=False, forward=forward_of(strategy, "bf16"), unit_gradients=strategy != "ddp"
        )
        estimate = estimate_model(
            gpt_parameter_shapes(config), strategy, 1 if strategy == "ddp" else 8, "bf16", activations
        )
        row = rows[strategy]
        assert row["activations GiB"] == f"{activations.peak / GIB:.1f}"
        held = estimate.state.total if strategy == "ddp" else estimate.state.params + estimate.state.optimizer
        assert row["peak per rank GiB"] == f"{(held + estimate.in_flight + activations.peak) / GIB:.1f}"
    assert rows["ddp"]["activations GiB"] != rows["full_shard"]["activations GiB"]  # autocast vs bf16 weights


def test_without_a_model_the_estimator_says_activations_need_one(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--params", "7e9", "--world-size", "8", "--gpu-memory", "80"])
    out = capsys.readouterr().out
    assert {row["activations GiB"] for row in table_rows(out).values()} == {"n/a"}
    assert "they need --model" in out


REFUSALS = [
    (["--params", "7e9", "--model", "tiny"], "give --params"),
    (["--params", "7e9", "--activation-checkpointing"], "activations need a model"),
    (["--params", "7e9", "--batch-size", "4"], "activations need a model"),
    (["--model", "mnist", "--mixed-precision", "bf16"], "the MNIST scripts have neither"),
    (["--model", "mnist", "--block-size", "64"], "describe the GPT, not MNIST"),
    (["--model", "tiny", "--n-head", "3"], "must be divisible by --n-head 3"),
    # Below 2**63, and so a flag's value, but a tensor's size no 64-bit count holds: the shape flags stop far below
    # (the logits and the convolution's output were refused as such), --lora-rank by the size of its factor.
    (["--model", "tiny", "--batch-size", str(2**62)], "must be at most 65,536 sequences or images"),
    (["--model", "tiny", "--lora-rank", str(2**62)], "more bytes than torch can count"),
    (["--model", "mnist", "--batch-size", str(2**62)], "must be at most 65,536 sequences or images"),
    # --d-model 1000000000 was a traceback: a q|k|v weight of 3 x 10**18 values ("Storage size calculation overflowed").
    (["--model", "tiny", "--d-model", str(10**9)], "--d-model: must be at most 65,536 features, got 1000000000"),
    # A fake step over 10**9 Blocks never ended (10 minutes at 1,000): refused past 128, with the way that is fast.
    (["--model", "tiny", "--n-layer", "129"], "must be at most 128 Blocks, got 129"),
    ([], "give --params"),
]


@pytest.mark.parametrize(("args", "message"), REFUSALS)
def test_the_estimator_refuses_flags_that_do_not_fit(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--world-size", "8", "--gpu-memory", "80"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err, err


@pytest.mark.parametrize("command", [estimate_memory, estimate_communication], ids=["memory", "communication"])
def test_a_model_over_more_ranks_than_can_be_worked_out_is_refused_and_params_answers(
    command: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --model each rank's share is worked out in turn: --world-size 2**61 ran on unended, 1,000,000 over a
    minute. --params answers for such a world at once."""
    job = ["--world-size", str(2**61), *(["--gpu-memory", "80"] if command is estimate_memory else [])]
    for model in (["--model", "tiny"], ["--model", "mnist"])[: 2 if command is estimate_memory else 1]:
        with pytest.raises(SystemExit) as exit_info:
            command.parse_args([*model, *job])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("with --model: each rank's share of every tensor") == 1, err
    command.parse_args(["--params", "7e9", *job])


def test_mnist_rows(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--model", "mnist", "--world-size", "2", "--gpu-memory", "16"])
    out = capsys.readouterr().out
    assert "MNIST net, 64 images per rank" in out
    assert f"ddp {mnist_activations(64).peak / MIB:,.1f} MiB" in out


# --- on a GPU: the predicted peak against CUDA's peak allocation in a real run --------------------

CUDA_CONFIG = ["--model", "medium", "--batch-size", "16", "--max-steps", "3", "--train-sequences", "256"]
CUDA_CONFIG += ["--heldout-sequences", "16", "--eval-interval", "1000", "--log-interval", "1"]
CUDA_WORKSPACES = 64 * MIB  # cuBLAS and cuBLASLt workspaces and allocator rounding, generously


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("precision", "checkpointing"), [("fp32", False), ("bf16", True)])
def test_the_predicted_peak_is_what_cuda_allocates(precision: str, checkpointing: bool, tmp_path: Path) -> None:
    """DDP on one GPU, the medium GPT: the final record's peak_memory_bytes (torch.cuda.max_memory_allocated
    over the training steps) against model state + in flight + activations, the backward's as the CPU
    measured it.

    The bounds come from what the estimate cannot know, counted from the shapes, not fitted: CUDA's
    backward kernels may hold other temporaries than the CPU's, up to three fp32 tensors of the MLP's width
    (GELU's output's gradient, its input's, fc's output's) either way; above, the workspaces; below, 2%
    for small tensors that CUDA's kernels save otherwise. Were CUDA's attention to save contiguous copies
    of q, k and v, the run would exceed the upper bound.
    """
    flags = ["--mixed-precision", precision, *(["--activation-checkpointing"] if checkpointing else [])]
    run = run_script("ddp/train_transformer.py", [*CUDA_CONFIG, *flags, "--device", "cuda"], tmp_path, nproc=1)
    measured = run.check().final()["peak_memory_bytes"]

    config = GPTConfig(vocab_size=16, **GPT_PRESETS["medium"])
    batch, tokens = 16, 16 * config.block_size
    forward = forward_of("ddp", precision)
    activations = gpt_activations(config, batch, checkpointing=checkpointing, forward=forward)
    predicted = estimate_model(gpt_parameter_shapes(config), "ddp", 1, precision, activations).peak_per_rank
    backward_gradients = 3 * tokens * 4 * config.d_model * 4
    low, high = 0.98 * (predicted - backward_gradients), predicted + backward_gradients + CUDA_WORKSPACES
    assert low <= measured <= high, (
        f"measured {measured / MIB:.1f} MiB, predicted {predicted / MIB:.1f} MiB "
        f"(activations {activations.peak / MIB:.1f}), bounds {low / MIB:.1f} to {high / MIB:.1f}\n{run.describe()}"
    )
    assert math.isfinite(run.final()["eval_loss"])
