"""Fine-tuning part of a model: --freeze under DDP, FSDP1 and FSDP2.

A frozen parameter must end the run exactly as it started (its --init-from value), every other one
must train, and what a rank holds and sends must scale with what trains: DDP all-reduces no bucket
of frozen gradients, and no rank keeps gradients or optimizer state for them. tools.estimates.estimate_memory
and tools.estimates.estimate_communication, told the same flags, must say what those runs recorded.
"""

from __future__ import annotations

import runpy
from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import torch

from common.checkpoint import identity_mismatch
from common.collectives import Traffic
from common.fine_tuning import (
    DEFAULT_LORA_TARGETS,
    LowRankUpdate,
    adapter_identity,
    add_adapters,
    merge_adapters,
    trained_parameters,
)
from common.models import GPT, GPTConfig
from tests.harness.cases import FSDP2_SCRIPT, NEEDS_FSDP2_ON_CPU
from tests.harness.model_files import assert_same_parameters
from tests.harness.runs import REPO, run_script
from tools.estimates import estimate_communication, estimate_memory
from tools.runs import export_checkpoint
from tools.runs.export_checkpoint import apply_adapters

SMALL = ["--block-size", "32", "--train-sequences", "320", "--heldout-sequences", "40"]
# The token embedding (in the root unit, beside trainable parameters) and the first Block (a unit of its own).
FROZEN = ["tok_emb.*", "blocks.0.*"]
FREEZE_FLAGS = [flag for pattern in FROZEN for flag in ("--freeze", pattern)]
# A LoRA run's held-out loss (adapters beside the weights, 2 processes) against its model.pt's (merged, one
# process): measured 3.6e-8 relative on the AVX-512 kernel and on AVX2, about one float32 rounding step.
MERGED_LOSS = 1e-6


# Each strategy at a world size of its own: FSDP2's uneven shards at 3.
STRATEGIES = [
    ("ddp/train_transformer.py", 2),
    ("fsdp/train_transformer.py", 2),
    pytest.param(FSDP2_SCRIPT, 3, marks=NEEDS_FSDP2_ON_CPU),
]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few steps of DDP in one process: the weights a user fine-tunes."""
    run_dir = tmp_path_factory.mktemp("fine_tuning") / "base"
    run_script("ddp/train_transformer.py", [*SMALL, "--max-steps", "4"], run_dir).check()
    return run_dir / "model.pt"


def frozen(name: str) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in FROZEN)


def assert_the_estimators_say_what_the_run_recorded(final: dict, fine_tuning: list[str]) -> None:
    """Told the run's model, world size and fine-tuning flags, tools.estimates.estimate_memory and
    tools.estimates.estimate_communication give its final record exactly: the bytes of parameters, gradients and
    optimizer state of the rank that holds the most, and one step's collectives, bytes and count by kind."""
    model = ["--model", "tiny", "--world-size", str(final["world_size"]), *fine_tuning]
    model += [f"--{name.replace('_', '-')}={value}" for name, value in final["model_config"].items()]
    strategy, group = final["strategy"], final["shard_group_size"]
    tuned = estimate_memory.parse_args([*model, "--gpu-memory", "80"]).fine_tuning
    held = estimate_memory.between_steps(tuned.shapes, group, estimate_memory.LAYOUTS[strategy], tuned.trainable)
    assert held.as_dict() == final["local_state_bytes"], (held, final)
    estimated = estimate_communication.model_estimates(estimate_communication.parse_args(model))[strategy]
    assert (estimated[0], estimated[1]) == (group, held), (estimated, final)
    sent = Traffic.of(estimated[2])
    assert (sent.bytes, sent.counts) == (final["comm_bytes_per_step"], final["collectives_per_step"]), (sent, final)


@pytest.mark.parametrize(("script", "nproc"), STRATEGIES)
def test_frozen_parameters_end_as_they_started_and_only_the_rest_is_trained_stored_and_sent(
    script: str, nproc: int, weights: Path, tmp_path: Path
) -> None:
    run = run_script(script, [*SMALL, "--init-from", str(weights), *FREEZE_FLAGS, "--max-steps", "3"], tmp_path, nproc)
    run.check()
    start, end = torch.load(weights, weights_only=True), torch.load(tmp_path / "model.pt", weights_only=True)
    unchanged = sorted(name for name in start if torch.equal(start[name], end[name]))
    assert unchanged == sorted(filter(frozen, start)), run.describe()  # the frozen ones, bit for bit, and no other
    trainable_bytes = sum(4 * value.numel() for name, value in start.items() if not frozen(name))
    final = run.final()
    state = final["local_state_bytes"]
    shards = 1 if script.startswith("ddp") else nproc
    # The rank that holds the most: a shard of each unit is padded (FSDP2: whole rows of each parameter; FSDP1:
    # to a multiple of the world size), and FSDP1 splits a unit's frozen and trainable values unevenly over the
    # ranks. Measured 1.019 (FSDP1, 2 ranks) and 1.018 (FSDP2, 3) times the even share; a frozen parameter
    # with a gradient would make it twice that.
    assert trainable_bytes / shards <= state["grads"] < 1.05 * trainable_bytes / shards, final
    assert state["optimizer"] < 2.1 * state["grads"], final  # AdamW's two moments (and step counters) only
    sent = final["comm_bytes_per_step"]
    if script.startswith("ddp"):
        # The buckets hold the trainable gradients only (the step's other all-reduces are a scalar or two).
        assert trainable_bytes <= sent["all_reduce"] < trainable_bytes + 64, final
    else:
        assert sent["reduce_scatter"] < 1.05 * trainable_bytes, final
    assert_the_estimators_say_what_the_run_recorded(final, FREEZE_FLAGS)


def test_a_pattern_that_matches_no_parameter_or_leaves_none_to_train_is_refused_with_one_message(
    weights: Path, tmp_path: Path
) -> None:
    run = run_script("ddp/train_transformer.py", [*SMALL, "--freeze", "block.0.*", "--max-steps", "3"], tmp_path, 2)
    assert run.returncode == 2, run.describe()
    assert run.output.count("--freeze 'block.0.*' matches no parameter of the model") == 1, run.describe()
    assert not (tmp_path / "model.pt").exists() and not (tmp_path / "checkpoints").exists(), run.describe()
    # With --lora-rank the base is frozen already: freezing every adapter too would leave nothing to train.
    frozen_all = [*SMALL, "--lora-rank", "4", "--freeze", "*.adapter.*", "--max-steps", "3"]
    run = run_script("ddp/train_transformer.py", frozen_all, tmp_path / "adapters", 2)
    assert run.returncode == 2, run.describe()
    assert run.output.count("nothing would be trained") == 1, run.describe()
    # A rank above a layer's width is no lower-rank than the layer: 100000 on width 64 ran 450 s in 10.9 GB.
    too_wide = [*SMALL, "--lora-rank", "100000", "--max-steps", "3"]
    run = run_script("ddp/train_transformer.py", too_wide, tmp_path / "too_wide", 2)
    assert run.returncode == 2, run.describe()
    assert run.output.count("--lora-rank 100000 is above the width of blocks.0.attn.qkv") == 1, run.describe()
    assert not (tmp_path / "too_wide").exists(), run.describe()


@pytest.mark.parametrize(("script", "nproc"), STRATEGIES)
def test_every_lora_adapter_trains_from_the_first_step_and_model_pt_is_the_plain_model(
    script: str, nproc: int, weights: Path, tmp_path: Path
) -> None:
    """Adapters that silently got no gradient under FSDP in 31 of 32 layers (meta-pytorch/torchforge#592) would
    leave their B at zero, where it starts; here every adapter's B has moved after one step. Three steps, for the
    third's measured collectives (common.collectives), which the estimators must predict."""
    full = [] if script.startswith("ddp") else ["--checkpoint-format", "full"]
    flags = [*SMALL, "--init-from", str(weights), "--lora-rank", "4", "--max-steps", "3", "--checkpoint-interval", "1"]
    run = run_script(script, [*flags, *full, "--keep-checkpoints", "3"], tmp_path, nproc).check()
    start = torch.load(weights, weights_only=True)
    after_one_step = torch.load(tmp_path / "checkpoints" / "step-1.pt", weights_only=True)["model"]
    b_halves = {name: value for name, value in after_one_step.items() if name.endswith(".adapter.b")}
    linears = [name for name in start if name.startswith("blocks.") and name.endswith(".weight") and "ln" not in name]
    assert len(b_halves) == len(linears) == 8, sorted(after_one_step)
    assert [name for name, b in b_halves.items() if not b.any()] == [], run.describe()
    assert all(torch.equal(after_one_step[name], start[name]) for name in start)  # the base is frozen
    model = GPT(GPTConfig(**run.final()["model_config"]))
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # strict: no adapter left over
    changed = [name for name in start if not torch.equal(model.state_dict()[name], start[name])]
    assert sorted(changed) == sorted(linears), run.describe()  # each adapter merged into the weight it adapts
    assert_the_estimators_say_what_the_run_recorded(run.final(), ["--lora-rank", "4"])


def test_a_lora_runs_model_pt_scores_what_the_run_scored(weights: Path, tmp_path: Path) -> None:
    flags = [*SMALL, "--init-from", str(weights), "--lora-rank", "4", "--max-steps", "3"]
    lora = run_script("ddp/train_transformer.py", flags, tmp_path / "lora", 2).check()
    merged = tmp_path / "lora" / "model.pt"
    plain = run_script("ddp/train_transformer.py", [*SMALL, "--init-from", str(merged), "--max-steps", "0"], tmp_path)
    assert plain.check().final()["eval_loss"] == pytest.approx(lora.final()["eval_loss"], rel=MERGED_LOSS)


def test_fsdp1_refuses_fine_tuning_where_it_would_not_shard(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Unsharded (one process, or no_shard), FSDP1 keeps a unit with nothing to train (and nothing trainable below
    it) as plain tensors after a step, and the run's end failed in torch's state-dict hook: the frozen embeddings'
    unit under --freeze, or under LoRA the first Block's own unit."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    parse_args = runpy.run_path(str(REPO / "fsdp/train_transformer.py"))["parse_args"]
    cases = [("1", "full_shard", ["--lora-rank", "4"]), ("2", "no_shard", ["--lora-rank", "4"])]
    cases += [("1", "full_shard", ["--freeze", "tok_emb.*", "--freeze", "pos_emb.*", "--freeze", "ln_f.*"])]
    for world_size, strategy, fine_tuning in cases:
        launch = {"WORLD_SIZE": world_size, "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
        for name, value in launch.items():  # what torchrun sets; nothing connects while flags are parsed
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as exit_info:
            parse_args(["--run-dir", str(tmp_path / "run"), *fine_tuning, "--sharding-strategy", strategy])
        assert exit_info.value.code == 2
        assert "--freeze and --lora-rank under FSDP1 need 2 or more processes" in capsys.readouterr().err


def test_a_lora_checkpoint_resumes_only_with_its_adapters_and_exports_them_alone(tmp_path: Path) -> None:
    """Resumed without --lora-rank, a LoRA checkpoint ended in a state dict's traceback ("Unexpected key(s)")."""
    flags = [*SMALL, "--lora-rank", "4", "--checkpoint-interval", "2"]
    run_script("ddp/train_transformer.py", [*flags, "--max-steps", "2"], tmp_path).check()
    checkpoint = tmp_path / "checkpoints" / "step-2.pt"
    plain = run_script("ddp/train_transformer.py", [*SMALL, "--resume", "--max-steps", "4"], tmp_path)
    assert plain.returncode == 2, plain.describe()
    assert (
        plain.output.count("--lora-rank: the checkpoint has LoRA adapters ({'rank': 4, 'scale': 2.0, 'layers': 8})")
        == 1
    ), plain.describe()
    assert "Traceback" not in plain.output and checkpoint.exists(), plain.describe()
    adapters = tmp_path / "adapters.pt"
    assert export_checkpoint.main([str(checkpoint), str(adapters), "--adapters-only"]) == 0
    exported = torch.load(adapters, weights_only=True)
    assert sorted(exported) == sorted(
        [*(n for n in exported if n.endswith((".adapter.a", ".adapter.b"))), "lora_scale"]
    )
    assert len(exported) == 17, sorted(exported)
    merged = tmp_path / "merged.pt"
    assert export_checkpoint.main([str(checkpoint), str(merged)]) == 0
    assert_same_parameters(merged, tmp_path / "model.pt")  # as the run's own model.pt: adapters merged in
    # The adapters file read back: on the base weights it gives that model.pt again, its scale included.
    base = {
        name: value
        for name, value in torch.load(checkpoint, weights_only=True)["model"].items()
        if "adapter" not in name
    }
    torch.save(apply_adapters(base, exported), tmp_path / "applied.pt")
    assert_same_parameters(tmp_path / "applied.pt", tmp_path / "model.pt")
    # --overwrite replaces an export or a model.pt, never the run's training log.
    log = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(SystemExit):
        export_checkpoint.main([str(checkpoint), str(tmp_path / "metrics.jsonl"), "--overwrite"])
    assert (tmp_path / "metrics.jsonl").read_bytes() == log


@pytest.mark.parametrize(
    ("saved", "resumed", "said"),
    [
        (["--freeze", "tok_emb.*", "--freeze", "blocks.0.*"], ["--freeze", "tok_emb.*"], "--freeze differ: "),
        (
            ["--lora-rank", "4", "--lora-targets", "blocks.*.attn.*"],
            ["--lora-rank", "4", "--lora-targets", "blocks.*.mlp.*"],
            "--lora-targets differ: 'blocks.0.attn.proj.adapter.a' and 7 more train there but not here",
        ),
    ],
    ids=["fewer-freeze-patterns", "other-lora-targets-as-many-layers"],
)
def test_a_resume_that_trains_other_parameters_names_the_setting(
    saved: list[str], resumed: list[str], said: str, tmp_path: Path
) -> None:
    """The checkpoint recorded how many adapters, not which, nor what --freeze froze: the resume failed in
    torch's state dict code ("Missing optimizer state for parameter", "Missing key: ...adapter.a")."""
    first = [*SMALL, *saved, "--max-steps", "2", "--checkpoint-interval", "2"]
    run_script("ddp/train_transformer.py", first, tmp_path).check()
    refused = run_script("ddp/train_transformer.py", [*SMALL, *resumed, "--resume", "--max-steps", "4"], tmp_path)
    assert refused.returncode == 2, refused.describe()
    assert refused.output.count(said) == 1 and "Traceback" not in refused.output, refused.describe()
    assert (tmp_path / "checkpoints" / "step-2.pt").exists(), refused.describe()


def adapted_identity(rank: int | None, alpha: float | None, targets: list[str]) -> dict[str, object]:
    """What a checkpoint of the tiny GPT records of its adapters (``rank`` None: no --lora-rank), built in process."""
    with torch.device("meta"):
        model = GPT(TINY, seed=None)
    add_adapters(model, rank, alpha, targets, seed=0)
    return {"model": TINY.shape(), "lora": adapter_identity(model), "tied": None, "trained": trained_parameters(model)}


ATTENTION, MLP, FIRST_BLOCK = "blocks.*.attn.*", "blocks.*.mlp.*", "blocks.0.*"


@pytest.mark.parametrize(
    ("saved", "resumed", "said"),
    [
        # The case: 8 layers there, 4 here, "lora is {...} there, {...} here" named no flag.
        ((2, None, [ATTENTION, MLP]), (2, None, [ATTENTION]), ["--lora-targets differ: adapters on 8 layers there, "
         "4 here; 'blocks.0.mlp.fc' and 3 more are adapted there but not here"]),
        ((4, None, [FIRST_BLOCK]), (4, None, [ATTENTION, MLP]), ["--lora-targets differ: adapters on 4 layers there, "
         "8 here; 'blocks.1.attn.proj' and 3 more are adapted here but not there"]),
        # Other layers and another rank: both flags named.
        ((4, None, [ATTENTION]), (2, None, [MLP]), ["--lora-rank 4 there, 2 here", "'blocks.0.attn.proj' and 3 more "
         "are adapted there but not here; 'blocks.0.mlp.fc' and 3 more are adapted here but not there"]),
        ((4, 8.0, [ATTENTION]), (4, 4.0, [ATTENTION]),
         ["--lora-alpha: the update is scaled by 2 there, 1 here"]),
        ((None, None, []), (4, None, [MLP]), ["--lora-rank unset there, 4 here; --lora-targets differ: adapters on 0 "
         "layers there, 4 here; 'blocks.0.mlp.fc' and 3 more are adapted here but not there"]),
        ((4, None, [MLP]), (None, None, []), ["--lora-rank: the checkpoint has LoRA adapters"]),
    ],
    ids=["fewer-layers", "more-layers", "other-layers-and-rank", "other-alpha", "adapters-added", "adapters-dropped"],
)  # fmt: skip
def test_a_resume_with_other_adapters_names_each_lora_flag_that_differs(
    saved: tuple, resumed: tuple, said: list[str]
) -> None:
    """The checkpoint's identity against the resumed run's, as the scripts compare them before loading anything.
    A checkpoint from before "trained" was recorded still names --lora-targets, by the counts alone."""
    there, here = adapted_identity(*saved), adapted_identity(*resumed)
    message = identity_mismatch(there, here)
    assert message is not None and all(part in message for part in said), message
    if there["lora"] and here["lora"] and there["lora"]["layers"] != here["lora"]["layers"]:
        unrecorded = identity_mismatch({key: value for key, value in there.items() if key != "trained"}, here)
        assert unrecorded is not None and "--lora-targets differ: adapters on " in unrecorded, unrecorded


def test_fsdp1_lora_resumes_its_own_sharded_checkpoint_at_3_processes(tmp_path: Path) -> None:
    """At 3 ranks the last rank holds none of a LoRA unit's A, FSDP1 leaves it out of that rank's state dict,
    and DCP took the missing key for a checkpoint of torch 2.3: "Missing key in checkpoint state_dict:
    optimizer.param_groups", reported as a damaged checkpoint. Resumed, the run ends where it would have."""
    flags = [*SMALL, "--lora-rank", "4", "--max-steps", "4", "--checkpoint-interval", "2"]
    whole = run_script("fsdp/train_transformer.py", flags, tmp_path / "whole", 3).check()
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-2"
    resume = [*flags, "--resume-from", str(checkpoint)]
    resumed = run_script("fsdp/train_transformer.py", resume, tmp_path / "resumed", 3)
    assert "resumed from" in resumed.check().output, resumed.describe()
    assert resumed.final()["eval_loss"] == whole.final()["eval_loss"], resumed.describe()
    assert_same_parameters(tmp_path / "resumed" / "model.pt", tmp_path / "whole" / "model.pt")


# The GPT of the runs above (SMALL, the tiny preset, the synthetic tokens' vocabulary), built in process.
TINY = GPTConfig(vocab_size=16, block_size=32, n_layer=2, n_head=4, d_model=64)
# A LoRA layer's output against its formula in float64, and merged weights' logits against the adapted model's:
# measured up to 2.1e-7 and 3.7e-7 on AVX-512 and AVX2 (torch's plain vector code: 1.8e-7 and 3.0e-7), on outputs
# up to 1.06 that the adapters move by up to 0.73; an update scaled by rank / alpha moves them by 0.36 or more.
LORA_ATOL = 1e-5


def tokens_of(seed: int) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (4, TINY.block_size), generator=torch.Generator().manual_seed(seed))


def trained_adapters(model: torch.nn.Module, seed: int) -> None:
    """Each adapter's B away from zero, by about what a few steps of AdamW at lr 1e-2 move it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LowRankUpdate):
                module.b.copy_(0.02 * torch.randn(module.b.shape, generator=generator))


def test_adding_adapters_leaves_the_models_output_unchanged_bit_for_bit() -> None:
    """B starts at zero, so fine-tuning starts from the pretrained model. With B drawn small and random instead,
    a 0-step LoRA run scored 2.79409 where its base scored 2.79338 (issue 56), and no other test saw it."""
    model = GPT(TINY, seed=1).eval()
    with torch.no_grad():
        before = model(tokens_of(0))
        add_adapters(model, 4, None, DEFAULT_LORA_TARGETS, seed=1)
        after = model(tokens_of(0))
    assert torch.equal(after, before), f"adapters moved the logits by up to {(after - before).abs().max():.3g}"


@pytest.mark.parametrize(("alpha", "scale"), [(None, 2.0), (12.0, 3.0)], ids=["alpha-default", "alpha-12"])
def test_a_lora_layer_computes_its_base_plus_alpha_over_rank_times_b_a_x(alpha: float | None, scale: float) -> None:
    """x W^T + b + (alpha / rank) (x A^T) B^T, with alpha 2 x rank when not given (docs/fine-tuning.md)."""
    model = GPT(TINY, seed=1)
    add_adapters(model, 4, alpha, ["blocks.0.mlp.fc"], seed=1)
    trained_adapters(model, seed=2)
    layer = model.blocks[0].mlp.fc
    inputs = torch.randn(4, TINY.block_size, TINY.d_model, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        found = layer(inputs).double()
    x, w, b, a, b_up = (
        t.detach().double() for t in (inputs, layer.weight, layer.bias, layer.adapter.a, layer.adapter.b)
    )
    expected = x @ w.T + b + scale * (x @ a.T) @ b_up.T
    drift = (found - expected).abs().max().item()
    assert drift < LORA_ATOL, f"the layer is {drift:.3g} away from x W^T + b + {scale:g} (x A^T) B^T"


@pytest.mark.parametrize("targets", [["blocks.*.attn.proj"], list(DEFAULT_LORA_TARGETS)], ids=["square", "default"])
def test_merged_adapters_compute_what_the_adapted_model_computes(targets: list[str]) -> None:
    """model.pt's W + (alpha / rank) B A, loaded into the plain GPT, gives the adapted model's logits. Only square
    layers (each Block's attention projection, 64 x 64): there a merge of (B A)^T has the right shape and no
    error; the default targets are 64 x 192 and 64 x 256 too."""
    model = GPT(TINY, seed=1).eval()
    add_adapters(model, 4, None, targets, seed=1)
    trained_adapters(model, seed=2)
    plain = GPT(TINY, seed=1).eval()
    plain.load_state_dict(merge_adapters(model.state_dict(), 4, None))  # strict: no adapter left over
    with torch.no_grad():
        adapted, merged, base = model(tokens_of(0)), plain(tokens_of(0)), GPT(TINY, seed=1).eval()(tokens_of(0))
    assert (adapted - base).abs().max() > 100 * LORA_ATOL  # the adapters change what the model computes
    drift = (merged - adapted).abs().max().item()
    assert drift < LORA_ATOL, f"the merged model's logits are {drift:.3g} away from the adapted model's"


ESTIMATORS = [
    (estimate_memory.main, ["--world-size", "2", "--gpu-memory", "80"]),
    (estimate_communication.main, ["--world-size", "2"]),
]


@pytest.mark.parametrize(("main", "job"), ESTIMATORS, ids=["estimate_memory", "estimate_communication"])
def test_the_estimators_refuse_fine_tuning_flags_they_cannot_apply_with_one_message(
    main: Callable[[list[str]], None], job: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    no_gpt = "--freeze, --lora-rank and --lora-targets name the parameters of a GPT"
    refused = [
        (["--params", "1e6", "--freeze", "blocks.0.*"], no_gpt),
        (["--params", "1e6", "--lora-rank", "4"], no_gpt),
        (["--model", "tiny", "--lora-targets", "blocks.*.mlp.*"], "give --lora-rank too"),
        (["--model", "tiny", "--freeze", "block.0.*"], "--freeze 'block.0.*' matches no parameter of the model"),
        (["--model", "tiny", "--lora-rank", "4", "--freeze", "*.adapter.*"], "nothing would be trained"),
        (["--model", "tiny", "--lora-rank", "4", "--lora-targets", "head.*"], "matches no linear layer"),
        (["--model", "tiny", "--lora-rank", "65"], "--lora-rank 65 is above the width of blocks.0.attn.qkv (64 in"),
    ]
    if main is estimate_memory.main:  # the only one of the two that takes the MNIST net
        refused.append((["--model", "mnist", "--freeze", "fc1.*"], no_gpt))
    for flags, said in refused:
        with pytest.raises(SystemExit) as exited:
            main([*job, *flags])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("error:") == 1 and said in err, (flags, err)
        assert "Traceback" not in err, err
