"""Mistakes in what each rank trains on and how a step adds it up: the sampler, gradient accumulation,
the evaluation, the learning-rate schedule."""

from __future__ import annotations

from tests.zoo.mistake import Mistake

# The equivalence tests' verdict when a run leaves the noise band of one process.
TRAINS_DIFFERENTLY = r"DIFFERENT"
EQUIVALENCE = "tests/test_equivalence.py"
ORDER = "tests/test_training_order.py::test_the_ranks_are_dealt_each_example_once_an_epoch_and_an_evaluation"
LOGGED_LR = "tests/test_training_order.py::test_the_logged_lr_is_the_schedules_after_each_step"
SET_EPOCH = "sampler.set_epoch(epoch, start=done_in_epoch * global_batch)\n"
LAST_MICRO_STEP = "last_micro_step = micro_step == len(micro_batches) - 1"

SAMPLER = [
    Mistake(
        name="ddp-no-set-epoch",
        path="ddp/train_transformer.py",
        edits={f"        {SET_EPOCH}": ""},
        test=ORDER,
        reason=r"epoch 2 dealt the same order as epoch 1: one shuffle repeated",
        harm="the sampler never hears of the epoch: every epoch repeats the first one's shuffle, batch for batch",
        notice="the loss curve shows the same bumps at the same place in every epoch; nothing fails",
    ),
    Mistake(
        name="ddp-set-epoch-once",
        path="ddp/train_transformer.py",
        edits={
            "    while step < total_steps:\n": "    sampler.set_epoch(step // steps_per_epoch + 1)\n"
            "    while step < total_steps:\n",
            f"        {SET_EPOCH}": "",
        },
        test=ORDER,
        reason=r"epoch 2 dealt the same order as epoch 1: one shuffle repeated",
        harm="set_epoch is called once, before the loop: one shuffle, repeated every epoch",
        notice="epochs after the first train on batches of the same make-up; only the first epoch looks right",
    ),
    Mistake(
        name="sampler-ignores-its-epoch",
        path="common/data.py",
        edits={"IndexShuffle(len(self.dataset), self.seed + self.epoch)": "IndexShuffle(len(self.dataset), self.seed)"},
        test="tests/test_data.py::test_the_sampler_deals_each_example_once_in_one_order_at_any_world_size",
        reason=r"each epoch its own shuffle",
        harm="a hand-written sampler seeds its shuffle without the epoch: set_epoch is called and changes nothing",
        notice="as with a missing set_epoch: every epoch the same order, with every call in place",
    ),
    Mistake(
        name="shuffle-with-three-feistel-rounds",
        path="common/data.py",
        edits={"SHUFFLE_ROUNDS = 6\n": "SHUFFLE_ROUNDS = 3\n"},
        test="tests/test_data.py::test_the_samplers_order_is_shuffled_like_a_random_permutation",
        # Seed 1 stays inside the mean's and the near neighbours' bands: only the whole distribution shows it.
        reason=r"seed 1 \(chi-square\)",
        harm="the shuffle's Feistel network cut to half its rounds: the order keeps the network's structure, and "
        "neighbours in the data land at distances from each other that a random order would not give them",
        notice="nothing in the loss on shuffled data; on data stored in blocks (by class, by source) some "
        "batches hold more of one block than a random order would give them",
    ),
    Mistake(
        name="fsdp1-sampler-seed-per-rank",
        path="fsdp/train_transformer.py",
        edits={
            "CompactDistributedSampler(data.train, ctx.world_size, ctx.rank, seed=args.seed)": (
                "CompactDistributedSampler(data.train, ctx.world_size, ctx.rank, seed=args.seed + ctx.rank)"
            )
        },
        test=f"{EQUIVALENCE}::test_transformer_matches_one_process[fsdp1-full_shard-2]",
        reason=TRAINS_DIFFERENTLY,
        harm="each rank shuffles with its own seed, so the ranks' slices overlap: some examples are trained on "
        "twice an epoch and others never",
        notice="the held-out loss is worse than a one-GPU run's after the same epochs, more so with more GPUs",
    ),
    Mistake(
        name="ddp-torch-sampler-without-drop-last",
        path="ddp/train_transformer.py",
        edits={
            "from common.checkpoint import Checkpointer, full_state_dict_options\n": (
                "from torch.utils.data import DistributedSampler\n\n"
                "from common.checkpoint import Checkpointer, full_state_dict_options\n"
            ),
            "sampler = CompactDistributedSampler(data.train, ctx.world_size, ctx.rank, seed=args.seed)": (
                "sampler = DistributedSampler(data.train, ctx.world_size, ctx.rank, seed=args.seed)"
            ),
            # torch's set_epoch has no start: a resume would read the epoch from its beginning again.
            SET_EPOCH: "sampler.set_epoch(epoch)\n",
        },
        test=ORDER,
        reason=r"examples dealt twice \(to one rank or to two\)",
        harm="torch's sampler without drop_last pads every epoch with repeated examples so the ranks come out even",
        notice="nothing visible: a few examples weigh double every epoch, more with more GPUs and smaller data",
    ),
    Mistake(
        name="uneven-ranks-without-drop-last",
        path="common/data.py",
        edits={"shuffle=True, seed=seed, drop_last=True)": "shuffle=True, seed=seed)"},
        test="tests/test_data.py::test_the_sampler_deals_each_example_once_in_one_order_at_any_world_size",
        reason=r"IndexError: positions \d+ to \d+ of an order of",
        harm="without drop_last the slices differ by one example, so one rank runs out of batches a step before "
        "the others",
        notice="at the end of an epoch one rank runs out of batches: the job fails, or hangs until the collective "
        "timeout, on some GPU counts only",
    ),
    Mistake(
        name="short-last-batch",
        path="common/data.py",
        edits={"sampler=sampler, drop_last=True,": "sampler=sampler,"},
        test=ORDER,
        reason=r"a batch not of --batch-size 8",
        harm="the loader keeps each epoch's last, short batch: one step an epoch averages fewer examples",
        notice="a noisier loss and grad norm at the last step of every epoch, one step more an epoch than expected",
    ),
]

WINDOWS = [
    Mistake(
        name="token-file-target-two-tokens-on",
        path="common/tokens.py",
        edits={
            "wanted = (self.block_size + 1) * TOKEN_BYTES": "wanted = (self.block_size + 2) * TOKEN_BYTES",
            "window = torch.from_numpy(ids.astype(np.int64))\n        return window[:-1], window[1:]": (
                "window = torch.from_numpy(ids.astype(np.int64))\n        return window[:-2], window[2:]"
            ),
        },
        test="tests/test_token_files.py::test_every_windows_targets_are_its_inputs_one_token_on",
        reason=r"targets not the inputs one token on: token file, train window 0",
        harm="each window of a token file reads one token more and pairs every input with the token after next: "
        "the model learns to skip a token, at the same shapes and speed",
        notice="nothing fails: the loss on a token file stays above what the same text reaches through --text-file",
    ),
]

ACCUMULATION = [
    Mistake(
        name="tokens-counted-on-this-rank-only",
        path="common/training.py",
        edits={"    dist.all_reduce(count)\n    return count": "    return count"},
        # Only padded data counts its tokens (TokenCount); sequences of one length know the count beforehand.
        test=f"{EQUIVALENCE}::test_variable_lengths_match_one_process[ddp-3x4-accum]",
        reason=TRAINS_DIFFERENTLY,
        harm="on padded data each rank divides its summed loss by its own tokens, not the whole step's: the "
        "gradient is N times too large, and ranks with fewer tokens weigh more",
        notice="on padded data the logged loss and grad norm grow with the number of GPUs",
    ),
    Mistake(
        name="padding-counted-as-tokens",
        path="common/training.py",
        edits={
            "local = sum((targets != IGNORE_INDEX).sum() for _, targets in micro_batches)": (
                "local = sum(torch.tensor(targets.numel()) for _, targets in micro_batches)"
            )
        },
        test=f"{EQUIVALENCE}::test_the_training_loss_is_a_mean_over_the_real_tokens",
        reason=r"the training loss of step 1 is [\d.]+ where the model as it starts scores [\d.]+ held out",
        harm="the step's token count takes in padded (ignored) targets: on padded data every step's loss and "
        "gradient are divided by too many tokens, by a factor that changes with the batch's lengths",
        notice="on padded data the logged training loss is far below the held-out loss from the first step "
        "(1.5 against 2.8), while the held-out loss looks normal",
    ),
    Mistake(
        name="ddp-never-syncs",
        path="ddp/train_transformer.py",
        edits={LAST_MICRO_STEP: "last_micro_step = micro_step == len(micro_batches)"},
        test=f"{EQUIVALENCE}::test_transformer_matches_one_process[ddp-2]",
        reason=TRAINS_DIFFERENTLY,
        harm="an off-by-one: no micro-step is the last, so no_sync skips the gradient all-reduce every time and "
        "each rank steps with its own gradient",
        notice="the replicas drift apart silently; the logged loss and grad norm are rank 0's alone",
    ),
    Mistake(
        name="ddp-sync-on-the-first-micro-step",
        path="ddp/train_transformer.py",
        edits={LAST_MICRO_STEP: "last_micro_step = micro_step == 0"},
        test=f"{EQUIVALENCE}::test_transformer_matches_one_process[ddp-2x2-accum]",
        reason=TRAINS_DIFFERENTLY,
        harm="no_sync on the wrong micro-steps: gradients are all-reduced after the first micro-step, and what "
        "the later ones add stays on each rank, so the replicas drift apart",
        notice="with --grad-accum-steps above 1 the run trains worse than without, at the same global batch; "
        "FSDP1 even fails in the optimizer",
    ),
    Mistake(
        name="fsdp2-mean-loss-per-micro-batch",
        path="fsdp/train_transformer_fsdp2.py",
        edits={
            "loss = summed * ctx.world_size / tokens": (
                "loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())"
            )
        },
        test=f"{EQUIVALENCE}::test_variable_lengths_match_one_process[fsdp2-3x2-accum]",
        reason=TRAINS_DIFFERENTLY,
        harm="each micro-step's mean loss, not divided by the micro-steps nor the step's tokens: the gradient is "
        "K times too large and short sequences' tokens weigh more",
        notice="changing --grad-accum-steps at the same global batch changes the loss curve and the gradient norm",
    ),
    Mistake(
        name="ddp-loss-not-times-world-size",
        path="ddp/train_transformer.py",
        edits={"loss = summed * ctx.world_size / tokens": "loss = summed / tokens"},
        test=f"{EQUIVALENCE}::test_transformer_matches_one_process[ddp-2]",
        reason=TRAINS_DIFFERENTLY,
        harm="the summed loss is divided by the global tokens and then averaged over ranks again: the gradient is "
        "1/N of the right one",
        notice="the logged grad norm halves each time the GPUs double; with SGD the run also slows down",
    ),
]

EVALUATION = [
    Mistake(
        name="eval-repeated-batch-counted",
        path="common/training.py",
        edits={"yield first, False": "yield first, True"},
        test=ORDER,
        reason=r"the evaluation counted 7 held-out sequences of 5",
        harm="a rank whose shard is a batch shorter runs its first batch again to keep in step, and counts it",
        notice="eval_samples exceeds the held-out set at some GPU counts and batch sizes, and the score shifts",
    ),
    Mistake(
        name="eval-padded-duplicates-counted",
        path="common/data.py",
        edits={
            "shard = eval_shard(dataset, ctx)": "shard = dataset",
            "batch_size, shuffle=False,": (
                "batch_size, sampler=DistributedSampler(dataset, ctx.world_size, ctx.rank, shuffle=False),"
            ),
        },
        test="tests/test_data.py::test_the_evaluation_loaders_deal_every_example_once",
        reason=r"evaluation loaders deal \d+ examples of 1999, \d+ of them more than once",
        harm="DistributedSampler pads the evaluation set so the ranks come out even: a few examples are scored twice",
        notice="the eval accuracy moves a little with the number of GPUs, and eval_samples exceeds the test set",
    ),
    Mistake(
        name="eval-a-ranks-partial-sum",
        path="common/training.py",
        edits={"    dist.all_reduce(totals)\n    return totals.tolist()": "    return totals.tolist()"},
        test=f"{EQUIVALENCE}::test_mnist_matches_one_process[ddp-3]",
        # The loss of one rank's third of 200 images can fall inside the noise band; the count cannot.
        reason=r"eval_samples 67 where one process scored 200",
        harm="the ranks' sums are never added up: rank 0 reports the score of its own share of the evaluation set",
        notice="eval_samples is 1/N of the test set, and the eval metrics jump when the GPU count changes",
    ),
    Mistake(
        name="logged-loss-is-rank-0s",
        path="common/bookkeeping.py",
        edits={"    dist.all_reduce(total, op=dist.ReduceOp.SUM)\n": ""},
        test=f"{EQUIVALENCE}::test_transformer_matches_one_process[ddp-2]",
        reason=r"DIFFERENT: beyond .*loss left the band first",
        harm="training is unchanged, but the logged training loss is rank 0's share, divided by the world size",
        notice="the logged loss falls by half when the GPUs double, while the eval loss stays put",
    ),
]

SCHEDULES = [
    Mistake(
        name="ddp-lr-logged-before-the-step",
        path="ddp/train_transformer.py",
        edits={
            "            scheduler.step()\n": (
                "            lr = scheduler.get_last_lr()[0]\n            scheduler.step()\n"
            ),
            "run.report(step, epoch, loss, grad_norm, scheduler.get_last_lr()[0])": (
                "run.report(step, epoch, loss, grad_norm, lr)"
            ),
        },
        test=LOGGED_LR,
        reason=r"logged lr is not the schedule's after that step",
        harm="training is unchanged, but each logged learning rate is the one of the step before",
        notice="the logged lr peaks one step after --warmup-steps and ends above the schedule's last value",
    ),
    Mistake(
        name="warmup-starts-at-zero",
        path="common/training.py",
        edits={"return (step + 1) / warmup_steps": "return step / warmup_steps"},
        test=LOGGED_LR,
        reason=r"logged lr is not the schedule's after that step",
        harm="an off-by-one in the warmup: the first step runs at lr 0 and the peak is reached a step late",
        notice="each logged lr of the warmup is the one of the step before: the peak is logged a step late",
    ),
    Mistake(
        name="fsdp1-mnist-steplr-every-step",
        path="fsdp/train_mnist.py",
        edits={
            "            step += 1\n": "            scheduler.step()\n            step += 1\n",
            "        scheduler.step()\n        result = evaluate(": "        result = evaluate(",
        },
        test=f"{EQUIVALENCE}::test_mnist_matches_one_process[fsdp1-full_shard-2]",
        reason=TRAINS_DIFFERENTLY,
        harm="StepLR, meant once per epoch, is stepped every optimizer step: the lr decays by --gamma each step",
        notice="the logged lr collapses within the first epoch and the loss stops falling",
    ),
    Mistake(
        name="ddp-mnist-steplr-before-the-epoch",
        path="ddp/train_mnist.py",
        edits={
            "        epoch, done_in_epoch = step // steps_per_epoch + 1, step % steps_per_epoch\n": (
                "        epoch, done_in_epoch = step // steps_per_epoch + 1, step % steps_per_epoch\n"
                "        scheduler.step()\n"
            ),
            "        scheduler.step()\n        result = evaluate(": "        result = evaluate(",
        },
        test="tests/test_training_order.py::test_the_logged_lr_of_the_cnn_decays_once_an_epoch",
        reason=r"logged lr is not --lr 1.0 x --gamma 0.7 per epoch before",
        harm="StepLR stepped at the start of each epoch (the order before PyTorch 1.1): the first epoch already "
        "runs at --lr times --gamma",
        notice="the logged lr of epoch 1 is below --lr, and torch warns that lr_scheduler.step() came before "
        "optimizer.step()",
    ),
]

MISTAKES: list[Mistake] = [*SAMPLER, *WINDOWS, *ACCUMULATION, *EVALUATION, *SCHEDULES]
