"""A Hugging Face causal LM through the three transformer scripts, as docs/hugging-face.md takes it.

A project is made as the page says: common/, examples/hf_model.py and a copy of each transformer script
with the page's edits applied (the very ``diff`` blocks a reader sees). Two tiny models, built from their
config classes and written with ``save_pretrained``, are the folders the runs start from: a
``LlamaForCausalLM`` (rotary frequencies, which no file holds) and a ``GPT2LMHeadModel`` (its head tied
to its token embedding). Each must train under DDP, FSDP1 and FSDP2 at 2 processes what one process
trains, resume where it stopped, and come back out as a folder ``from_pretrained`` loads strictly.
"""

from __future__ import annotations

import json
import re
import runpy
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")  # in requirements.txt; the floor pass's venv has none

from safetensors.torch import load_file  # noqa: E402 - transformers brings it

from common import check_equivalence, export_checkpoint  # noqa: E402
from common.tokens import IGNORE_INDEX, markov_data  # noqa: E402
from tests.harness.cases import NEEDS_FSDP2_ON_CPU  # noqa: E402
from tests.harness.copies import check_warm, copy_common, run_copy  # noqa: E402
from tests.harness.doc_edits import apply_edits, edits_by_script  # noqa: E402
from tests.harness.model_files import assert_same_parameters  # noqa: E402
from tests.harness.runs import REPO  # noqa: E402

COPIES = {
    "ddp": "ddp/train_transformer.py",
    "fsdp1": "fsdp/train_transformer.py",
    "fsdp2": "fsdp/train_transformer_fsdp2.py",
}
# Short sequences and a small held-out set: what each run costs is mostly its start and its evaluation.
DATA = ["--block-size", "32", "--train-sequences", "400", "--heldout-sequences", "61"]
# A global batch of 12 has four twins (2, 3, 4 and 6 micro-steps): the noise floor of several orders of summation.
CHECKED = [*DATA, "--global-batch-size", "12"]


def tiny_config(model: str) -> transformers.PretrainedConfig:
    """The tests' two models, small enough that a step costs less than the run around it. No special tokens:
    the synthetic data's 16 symbols are all the vocabulary holds."""
    tokens = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if model == "llama":
        return transformers.LlamaConfig(
            vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, **tokens,
        )  # fmt: skip
    return transformers.GPT2Config(vocab_size=16, n_embd=32, n_layer=2, n_head=4, n_positions=64, **tokens)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 to 3 of the page: common/, hf_model.py and the three copies with its edits; and the two
    folders the runs start from, written by the library itself."""
    project = tmp_path_factory.mktemp("hf-project")
    train = copy_common(project)
    shutil.copy(REPO / "examples" / "hf_model.py", train / "hf_model.py")
    edits = edits_by_script(REPO / "docs" / "hugging-face.md")
    assert set(edits) == set(COPIES.values()), "the page gives the edits of each transformer script"
    for name, script in COPIES.items():
        (train / f"{name}.py").write_text(apply_edits((REPO / script).read_text(), edits[script]))
    for model in ("llama", "gpt2"):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(tiny_config(model)).save_pretrained(project / "models" / model)
    return project


def from_folder(folder: Path) -> transformers.PreTrainedModel:
    """``from_pretrained`` as a user calls it, refusing a folder with any key missing, unexpected or reshaped."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), f"{folder}: {info}"
    return model.eval()


def heldout_loss(model: torch.nn.Module) -> float:
    """The held-out loss of the data the runs evaluate on (the flags of DATA), as the scripts compute it."""
    args = runpy.run_path(str(REPO / "ddp" / "train_transformer.py"))["parse_args"](DATA)
    data = markov_data(args.block_size, args.train_sequences, args.heldout_sequences, args.variable_length)
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, targets in torch.utils.data.DataLoader(data.heldout, batch_size=61):
            logits = model(inputs).logits
            loss_sum += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            tokens += int((targets != IGNORE_INDEX).sum())
    return float(loss_sum) / tokens


def assert_holds_the_names_save_pretrained_writes(folder: Path, model: str, project: Path) -> None:
    """A tied weight once, under the name the library keeps: the names of the folder the run started from."""
    written = load_file(folder / "model.safetensors").keys()
    assert written == load_file(project / "models" / model / "model.safetensors").keys()


def assert_is_the_trained_model(run_dir: Path, model: str, project: Path) -> None:
    """RUN_DIR/hf loads strictly, holds what model.pt holds (a tied weight one tensor), and scores the run's
    own final held-out loss: the logits of the model the run trained."""
    assert_holds_the_names_save_pretrained_writes(run_dir / "hf", model, project)
    exported = from_folder(run_dir / "hf")
    if model == "gpt2":
        assert exported.lm_head.weight is exported.transformer.wte.weight, "the tie did not survive the folder"
    fresh = transformers.AutoModelForCausalLM.from_config(tiny_config(model)).eval()
    fresh.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))  # strict
    inputs = torch.randint(0, 16, (4, 32))
    with torch.no_grad():
        assert torch.allclose(exported(inputs).logits, fresh(inputs).logits, rtol=0, atol=1e-5)
    final = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["event"] == "final"
    # The run summed in float64 over 2 ranks; here one process sums in float32: 1e-5 is far above either's rounding.
    assert heldout_loss(exported) == pytest.approx(final["eval_loss"], rel=1e-5)


# The stop and resume of each model: under the FSDP that makes it hardest (FSDP1 and a tied weight in one flat
# parameter; FSDP2 and rotary buffers), from a sharded checkpoint.
RESUMED = {"llama": "fsdp2", "gpt2": "fsdp1"}


@NEEDS_FSDP2_ON_CPU
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_each_strategy_trains_what_one_process_does_and_resumes_where_it_stopped(
    model: str, project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """check_equivalence --nproc 2 says SAME for the DDP, FSDP1 and FSDP2 copies, each against the DDP copy's
    one process and twins (made once, for the three checks). Each two-process run's RUN_DIR/hf is the model it
    trained. Then a run of the same flags, stopped at a step and resumed, ends bit for bit where the unbroken
    run ended, and its last checkpoint exports as a folder that is that model."""
    flags = ["--init-from", str(project / "models" / model), *CHECKED]
    made: dict[tuple, Path] = {}
    candidates = {}
    for strategy in COPIES:
        runs = tmp_path / strategy
        check = check_warm(project, f"train/{strategy}.py", flags, runs, capsys, "train/ddp.py", made)
        assert "20 steps compared; noise floor from 4 twin run(s)" in check.output, check.describe()
        assert_is_the_trained_model(check.run_dir, model, project)
        candidates[strategy] = check

    strategy = RESUMED[model]
    candidate = check_equivalence.plan(["--device", "cpu", *flags], 2)[-1].flags
    resumed_dir = tmp_path / "resumed"

    def stop_at_step_8(line: str) -> None:
        if line.startswith("step  8/20"):
            (resumed_dir / "STOP").touch()

    resumable = [*candidate, "--checkpoint-interval", "10"]
    stopped = run_copy(project, f"train/{strategy}.py", resumable, resumed_dir, 2, on_line=stop_at_step_8)
    stopped_at = re.search(r"stopped at step (\d+) on request", stopped.output)
    assert stopped.returncode == 0 and stopped_at and int(stopped_at.group(1)) < 20, stopped.describe()
    resumed = run_copy(project, f"train/{strategy}.py", [*resumable, "--resume"], resumed_dir, 2)
    assert resumed.returncode == 0 and f"at step {stopped_at.group(1)} " in resumed.output, resumed.describe()
    assert_same_parameters(resumed_dir / "model.pt", candidates[strategy].run_dir / "model.pt")

    exported = tmp_path / "exported"
    hf_config = str(project / "models" / model)
    assert (
        export_checkpoint.main([str(resumed_dir / "checkpoints" / "step-20"), str(exported), "--hf-config", hf_config])
        == 0
    )
    assert_holds_the_names_save_pretrained_writes(exported, model, project)
    trained = torch.load(resumed_dir / "model.pt", weights_only=True)
    loaded = from_folder(exported).state_dict()
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[name], trained[name]) for name in trained)
