"""Every mistake of the zoo, by the part of a training script it breaks."""

from __future__ import annotations

from tests.zoo import data_mistakes, fine_tuning_mistakes, state_mistakes, wrap_mistakes
from tests.zoo.mistake import Mistake

# The equivalence tests' verdict when a run leaves the noise band of one process.
TRAINS_DIFFERENTLY = r"DIFFERENT"
DDP_CLIP = "    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf)\n"

CLIPPING = [
    Mistake(
        name="fsdp1-clip-on-the-local-norm",
        path="fsdp/train_transformer.py",
        edits={
            "grad_norm = model.clip_grad_norm_(args.grad_clip or math.inf)": (
                "grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf)"
            )
        },
        test="tests/test_equivalence.py::test_transformer_matches_one_process[fsdp1-full_shard-2]",
        reason=TRAINS_DIFFERENTLY,
        harm="each rank clips its shard by its own shard's norm: the global norm is never computed, the "
        "logged norm is one rank's, and clipping scales every shard differently",
        notice="the logged grad norm is about 1/sqrt(N) of a one-GPU run's, and falls further as you add GPUs",
    ),
    Mistake(
        name="ddp-clip-inside-the-micro-steps",
        path="ddp/train_transformer.py",
        edits={
            # The clip moves into forward_backward, after each micro-step's backward; the loop logs the last one's.
            DDP_CLIP: "    grad_norm = forward_backward.last_norm\n",
            "        step_loss += loss.detach()\n": "        step_loss += loss.detach()\n"
            "        forward_backward.last_norm = " + DDP_CLIP.split(" = ", 1)[1],
        },
        # The DDP script is also the one-process reference and its twins: the comparisons of every script would
        # fail for its mistake. The bare loop, not built from its file, says which side is wrong.
        test="tests/test_equivalence.py::test_the_reference_script_trains_what_a_loop_of_its_own_trains",
        reason=r"ddp/train_transformer\.py is wrong, the one-process reference and twins of every equivalence test",
        harm="the gradient is clipped after every micro-step's backward, while it is still a part of the step's: "
        "the micro-steps that come first are scaled down more than the later ones, and the step's gradient is "
        "not the one a single batch gives",
        notice="with --grad-accum-steps above 1 and a clip that acts, the run trains differently from one without "
        "accumulation at the same global batch, and logs a smaller grad norm",
    ),
]

SCHEDULES = [
    Mistake(
        name="ddp-lr-times-world-size",
        path="ddp/train_transformer.py",
        edits={"args.lr, weight_decay": "args.lr * ctx.world_size, weight_decay"},
        test="tests/test_equivalence.py::test_transformer_matches_one_process[ddp-2]",
        reason=TRAINS_DIFFERENTLY,
        harm="the learning rate grows with the world size while the global batch stays the same",
        notice="the same recipe diverges or trains differently on 8 GPUs than on 2",
    ),
]

MISTAKES: list[Mistake] = [
    *CLIPPING,
    *SCHEDULES,
    *data_mistakes.MISTAKES,
    *wrap_mistakes.MISTAKES,
    *state_mistakes.MISTAKES,
    *fine_tuning_mistakes.MISTAKES,
]
