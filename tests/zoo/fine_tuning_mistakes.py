"""Mistakes in fine-tuning: LoRA adapters that do not start as no change, scale their update the wrong way,
or merge into the weights as another product than the one they trained as."""

from __future__ import annotations

from tests.zoo.mistake import Mistake

FINE_TUNING = "tests/test_fine_tuning.py"

LORA = [
    Mistake(
        name="lora-b-starts-random",
        path="common/models.py",
        edits={
            'if name.endswith("bias") or name.endswith(".adapter.b"):': 'if name.endswith("bias"):',
        },
        test=f"{FINE_TUNING}::test_adding_adapters_leaves_the_models_output_unchanged_bit_for_bit",
        reason=r"adapters moved the logits by up to",
        harm="each adapter's B starts small and random, like A, instead of at zero: the adapted model is not the "
        "pretrained one at step 0, and fine-tuning starts from a perturbed model",
        notice="a LoRA run of 0 steps scores other than its --init-from weights (2.79409 where they score 2.79338)",
    ),
    Mistake(
        name="lora-scale-inverted",
        path="common/fine_tuning.py",
        edits={
            "return (alpha if alpha is not None else 2.0 * rank) / rank": (
                "return rank / (alpha if alpha is not None else 2.0 * rank)"
            )
        },
        test=f"{FINE_TUNING}::test_a_lora_layer_computes_its_base_plus_alpha_over_rank_times_b_a_x[alpha-default]",
        reason=r"the layer is [\d.e-]+ away from x W\^T \+ b \+ 2 \(x A\^T\) B\^T",
        harm="the update is scaled by rank / alpha instead of alpha / rank: a quarter of the documented scale at "
        "the default alpha, and a larger --lora-alpha trains the adapters more slowly, not faster",
        notice="LoRA runs train more slowly than recipes at the same rank and alpha say, and raising --lora-alpha "
        "makes it worse",
    ),
    Mistake(
        name="lora-merge-transposed",
        path="common/fine_tuning.py",
        edits={
            'update = state[f"{layer}.adapter.b"].float() @ state[name].float()': (
                'update = state[name].float().T @ state[f"{layer}.adapter.b"].float().T'
            )
        },
        test=f"{FINE_TUNING}::test_merged_adapters_compute_what_the_adapted_model_computes[square]",
        reason=r"the merged model's logits are [\d.e-]+ away from the adapted model's",
        harm="model.pt merges (B A)^T into each weight instead of B A: on a square layer it has the right shape, so "
        "nothing fails and the merged model is not the one that trained",
        notice="with --lora-targets on square layers only, model.pt scores worse than the run's last evaluation; "
        "on any other layer the merge fails at the end of the run",
    ),
]

MISTAKES: list[Mistake] = [*LORA]
