"""Mistakes in what outlives a step: checkpoints and resuming, stop signals, the run directory's lock,
restarts, and the final model file."""

from __future__ import annotations

from tests.zoo.mistake import Mistake

# Where a run resumed mid-epoch starts: after the examples every rank trained.
RESUMED_EPOCH = "sampler.set_epoch(epoch, start=done_in_epoch * global_batch)"
STOP_AND_RESUME = "tests/test_checkpoint.py::test_stopped_and_resumed_run_matches_an_uninterrupted_one"
# The stopped-and-resumed run's losses, gradient norms and learning rates, step by step, are not the reference's.
RESUMES_DIFFERENTLY = r"assert train_history\(resumed\) == train_history\(reference\)"
# What the stopped-and-resumed run's loaders read is not, step for step, what the reference's read.
TRAINS_OTHER_EXAMPLES = r"trained other examples than the uninterrupted run's"
# The resumed run did not continue from the checkpoint the stop wrote, at the step it stopped.
RESUMED_ELSEWHERE = r"assert resumed\.output\.count\(f\"resumed from \{checkpoint\} at step \{stopped_at\}\"\) == 1"
# Right after the resume, the optimizer state the run holds is not the one the checkpoint holds.
OPTIMIZER_STATE_LOST = r"the optimizer state after the resume at step \d+ is not the uninterrupted run's"

CHECKPOINTS = [
    Mistake(
        name="rng-not-restored-on-resume",
        path="common/checkpoint.py",
        edits={'restore_rng(trainer["rng"])': "pass"},
        test=f"{STOP_AND_RESUME}[ddp-transformer]",
        reason=RESUMES_DIFFERENTLY,
        harm="a resumed run draws dropout masks from the freshly seeded stream again, not where it left off",
        notice="the loss curve after each requeue is not the one an uninterrupted run draws: runs do not reproduce",
    ),
    Mistake(
        name="scheduler-left-out-of-the-checkpoint",
        path="ddp/train_transformer.py",
        edits={'extra={"scheduler": scheduler},': "extra={},"},
        test=f"{STOP_AND_RESUME}[ddp-transformer]",
        reason=RESUMES_DIFFERENTLY,
        harm="after a resume the learning-rate schedule starts again from step 0: warmup again, then the "
        "cosine from its top",
        notice="the logged lr jumps back to the warmup at every requeue; the loss spikes right after each resume",
    ),
    Mistake(
        name="optimizer-state-not-loaded",
        path="common/checkpoint.py",
        edits={
            "            set_optimizer_state_dict(\n"
            '                self.model, self.optimizer, checkpoint["optimizer"] if self.ctx.is_main else {}, '
            "options=options\n"
            "            )\n": ""
        },
        test=f"{STOP_AND_RESUME}[ddp-transformer]",
        reason=OPTIMIZER_STATE_LOST,
        harm="a resumed run's Adam starts with zero moments and step count: its first updates are far too large",
        notice="a loss spike right after every resume, and a grad norm that jumps at the same step",
    ),
    Mistake(
        name="sharded-resume-resets-the-step-count",
        path="common/checkpoint.py",
        edits={
            "            state = tree_map_only(torch.Tensor, self.sharded_view, "
            '{"model": model_state, "optimizer": optimizer_state})\n': (
                "            state = tree_map_only(\n"
                "                torch.Tensor,\n"
                "                lambda tensor: self.sharded_view(tensor) if tensor.dim() else tensor.clone(),\n"
                '                {"model": model_state, "optimizer": optimizer_state},\n'
                "            )\n"
            )
        },
        test=f"{STOP_AND_RESUME}[fsdp2-transformer]",
        reason=OPTIMIZER_STATE_LOST + r": its step count \[1\.0\]",
        harm="a scalar (Adam's per-parameter step) has no shard to view, so it is cloned: DCP fills the clone and "
        "the optimizer keeps the step count get_state_dict gave it (1). Bias correction starts again, and the "
        "first updates after every sharded resume are far too large",
        notice="a loss spike right after each resume from a sharded checkpoint, none after a full one; the step "
        "counts in a checkpoint written after a resume are the steps since it",
    ),
    Mistake(
        name="resume-restarts-the-epoch",
        path="ddp/train_transformer.py",
        edits={RESUMED_EPOCH: "sampler.set_epoch(epoch)"},
        test=f"{STOP_AND_RESUME}[ddp-transformer]",
        reason=TRAINS_OTHER_EXAMPLES,
        harm="a run resumed mid-epoch trains the epoch's first batches again and never sees its last ones",
        notice="a dip in the loss right after each resume (batches seen twice); with frequent requeues part of "
        "the data is never trained on",
    ),
    Mistake(
        name="fsdp2-resume-skips-one-ranks-share",
        path="fsdp/train_transformer_fsdp2.py",
        edits={RESUMED_EPOCH: RESUMED_EPOCH.replace("global_batch", "args.batch_size * args.grad_accum_steps")},
        test=f"{STOP_AND_RESUME}[fsdp2-transformer]",
        reason=TRAINS_OTHER_EXAMPLES,
        harm="a resumed run starts after the examples one rank trained, not all of them: at N ranks it trains "
        "(N - 1)/N of the epoch's first part again",
        notice="nothing at one GPU; at several, a dip in the loss after each resume, deeper with more GPUs",
    ),
    Mistake(
        name="resume-picks-the-oldest-checkpoint",
        path="common/run_dir.py",
        edits={"return found[-1] if found else None": "return found[0] if found else None"},
        test=f"{STOP_AND_RESUME}[ddp-transformer]",
        reason=RESUMED_ELSEWHERE,
        harm="--resume continues from the oldest checkpoint kept, not the newest: the steps in between are trained "
        "again",
        notice="after a requeue the step count in the progress line goes back further than the checkpoint interval",
    ),
    Mistake(
        name="checkpoint-step-one-ahead",
        path="common/checkpoint.py",
        edits={'"step": step,': '"step": step + 1,'},
        test=f"{STOP_AND_RESUME}[ddp-mnist]",
        reason=RESUMED_ELSEWHERE,
        harm="a checkpoint records one step more than its state holds: each resume skips a step's batches and the "
        "schedule runs one step ahead",
        notice="the 'resumed ... at step N' line names one step past the 'stopped at step' line; each resumed run "
        "trains one step fewer",
    ),
    Mistake(
        name="sharded-checkpoint-saved-by-rank-0-alone",
        path="common/checkpoint.py",
        edits={
            "failure = safe_io.write_failure(lambda: dcp.save(state, checkpoint_id=temporary))": (
                "failure = safe_io.write_failure(lambda: dcp.save(state, checkpoint_id=temporary)) "
                "if self.ctx.is_main else None"
            )
        },
        test=f"{STOP_AND_RESUME}[fsdp1-transformer]",
        reason=r"in _save_sharded\n(.|\n)*Timed out waiting \d+ms",
        harm="rank 0 waits in DCP's collectives for ranks that never call them: the other ranks' shards are never "
        "written and the checkpoint never completes",
        notice="the job hangs at its first checkpoint until the collective timeout, then dies",
    ),
]

# The run asked to stop did not stop cleanly: it failed instead of checkpointing and exiting 0, with exit code 1,
# or -6 where the rank left behind aborts inside gloo when its peer is gone (seen on a slow machine).
STOP_FAILED = r">\s+stopped = run_until_stopped\((.|\n)*?E\s+exit code -?[1-9]"

STOP_SIGNALS = "tests/test_stop_signals.py::test_a_stop_signal_ends_the_run_with_a_checkpoint"

SIGNALS = [
    Mistake(
        name="sigusr1-not-a-stop-signal",
        path="common/distributed.py",
        edits={"STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)": "STOP_SIGNALS = (signal.SIGTERM,)"},
        test=f"{STOP_SIGNALS}[SIGUSR1]",
        reason=r"SIGUSR1 would have killed the run, with no checkpoint",
        harm="a job sent SIGUSR1 ahead of its time limit (sbatch --signal=USR1@SECONDS, to the job's steps) dies of "
        "it: no checkpoint, every step since the last one lost",
        notice="the job ends at the warning, not at the next step boundary: no 'stopped at step' line, no PREEMPTED "
        "marker, and the resume starts from an older checkpoint",
    ),
    Mistake(
        name="sigterm-not-a-stop-signal",
        path="common/distributed.py",
        edits={"STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)": "STOP_SIGNALS = (signal.SIGUSR1,)"},
        test=f"{STOP_SIGNALS}[SIGTERM]",
        reason=r"SIGTERM would have killed the run, with no checkpoint",
        harm="scancel, a preemption or torchrun stopping its workers kills the run outright: the steps since the "
        "last checkpoint are lost",
        notice="a preempted or cancelled job leaves no PREEMPTED marker and its resume starts from an older checkpoint",
    ),
    Mistake(
        name="stop-file-left-behind",
        path="common/distributed.py",
        edits={
            '(marker) + "\\n", overwrite=True)  # this run\'s own\n            self._remove_stop_file()\n': (
                '(marker) + "\\n", overwrite=True)  # this run\'s own\n'
            )
        },
        test="tests/test_run_dir.py::test_a_stop_request_during_startup_stops_the_run[file]",
        reason=r'assert \(run_dir / "PREEMPTED"\)\.exists\(\) and not \(run_dir / "STOP"\)\.exists\(\)',
        harm="the STOP that was obeyed stays in the run directory, so every resumed run stops again at its first step",
        notice="after a requeue the job checkpoints and exits at once, again and again, never training a step",
    ),
    Mistake(
        name="each-rank-decides-to-stop-alone",
        path="common/distributed.py",
        edits={
            "        answers, self.answers = self.answers, AgreementInFlight(not asked, self.ctx)\n"
            "        return answers is not None and not answers.all_agree()\n": "        return asked\n"
        },
        test=f"{STOP_AND_RESUME}[ddp-transformer]",
        reason=STOP_FAILED,
        harm="rank 0 sees the STOP file and leaves to checkpoint while the other ranks go on with the next step's "
        "collectives",
        notice="a job asked to stop hangs until the collective timeout, then fails instead of saving",
    ),
]

# The second run on a busy run directory was not refused: it trained (exit code 0).
NOT_REFUSED = r'>\s+one_message\(second, f"is in use by another run(.|\n)*>\s+assert run\.returncode != 0'

LOCKS = [
    Mistake(
        name="run-dir-lock-released-before-training",
        path="ddp/train_transformer.py",
        edits={
            "            with RunDirLock(args.run_dir, ctx) as lock, hang_watch:  # DISTRIBUTED: a hang ends in one "
            "report\n"
            "                train(args, settings, ctx, lock)\n": (
                "            with RunDirLock(args.run_dir, ctx) as lock:\n"
                "                pass\n"
                "            with hang_watch:\n"
                "                train(args, settings, ctx, lock)\n"
            )
        },
        test="tests/test_run_dir.py::test_one_run_at_a_time_and_a_killed_run_leaves_no_lock",
        reason=NOT_REFUSED,
        harm="a job submitted twice trains twice into one folder: interleaved metrics, checkpoints pruned and "
        "replaced by the other run",
        notice="metrics.jsonl holds each step twice with different losses; a resume picks up the other job's "
        "checkpoint",
    ),
    Mistake(
        name="run-dir-lock-file-closed-after-writing",
        path="common/run_dir.py",
        edits={
            "        self.fd = fd\n        return None\n": (
                "        os.close(fd)  # the holder is written\n        return None\n"
            )
        },
        test="tests/test_run_dir.py::test_one_run_at_a_time_and_a_killed_run_leaves_no_lock",
        reason=NOT_REFUSED,
        harm="closing the lock file drops the lock: nothing stops a second run from writing the same run directory",
        notice="two jobs on one --run-dir both train; their checkpoints and metrics.jsonl mix",
    ),
]

# The agreements on two gloo ranks, the one with the bad news entering late (tests/harness/late_agreement.py).
AGREEMENTS = "tests/test_agreements.py"
AGREEMENT_WAIT = "        self.work.wait()\n        return bool(self.flag.item())\n"

IN_FLIGHT = [
    Mistake(
        name="agreement-wait-never-called",
        path="common/distributed.py",
        edits={AGREEMENT_WAIT: "        self.work.wait\n        return bool(self.flag.item())\n"},
        test=f"{AGREEMENTS}::test_a_stop_request_of_a_late_rank_stops_every_rank_at_the_same_step",
        # Without the wait, rank 0 reads its own answer, or the all-reduce's where it was done in time: which, varies.
        reason=r"the stop agreement: rank 0 read \[False, False, (False|True)\] where rank 1, whose request it was",
        harm="the wait lacks its parentheses: each rank reads the flag it sent, or the answer, whichever the "
        "all-reduce has left there: a stop request that comes late reaches some ranks a step later or never",
        notice="a job asked to stop hangs in a collective (one rank checkpoints, the others train on), now and then, "
        "and more often the more ranks there are",
    ),
    Mistake(
        name="agreement-read-before-its-wait",
        path="common/distributed.py",
        edits={
            AGREEMENT_WAIT: "        answer = bool(self.flag.item())\n        self.work.wait()\n        return answer\n"
        },
        test=f"{AGREEMENTS}::test_a_checkpoint_a_late_rank_could_not_write_is_refused_by_every_rank",
        reason=r"the checkpoint agreement: rank 0 answered .* and published \[.*step-3'\)\] as complete",
        harm="the answer is read, then waited for: a rank that reaches a save's agreement first takes its own "
        "success for everyone's and publishes a checkpoint another rank could not write",
        notice="after a full disk or a dead node mid-save, --resume fails on a checkpoint that looks complete",
    ),
]

RESTARTS = [
    Mistake(
        name="restart-store-without-generation-prefix",
        path="common/distributed.py",
        edits={
            "return dist.PrefixStore(f\"restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\", store)": (
                "return store"
            )
        },
        test="tests/test_failures.py::test_each_restart_meets_in_a_store_of_its_own",
        reason=r"the restarted workers read the failed generation's keys",
        harm="workers restarted by torchrun --max-restarts read the failed generation's addresses from the store and "
        "connect to dead peers",
        notice="after a worker dies, the restart often fails too ('Connection refused') or hangs in init_process_group",
    ),
]

FINAL_MODEL = [
    Mistake(
        name="final-model-not-gathered",
        path="fsdp/train_mnist.py",
        edits={
            "state = get_model_state_dict(model, options=full_state_dict_options(ctx.device))": (
                "state = get_model_state_dict(model)"
            )
        },
        test="tests/test_fsdp.py::test_mnist_trains_and_saves_the_plain_model",
        reason=r"in save_model_file\n(.|\n)*not supported for ShardedTensor",
        harm="model.pt would hold rank 0's shards of each weight, not the whole model; here the run dies saving it, "
        "after all its training",
        notice="the job fails at its very end with a ShardedTensor error and leaves no model.pt",
    ),
    Mistake(
        name="final-model-saved-with-the-ddp-prefix",
        path="ddp/train_mnist.py",
        edits={
            "state = get_model_state_dict(model, options=full_state_dict_options(ctx.device))": (
                "state = model.state_dict()"
            )
        },
        test="tests/test_ddp.py::test_mnist_trains",
        reason=r'Unexpected key\(s\) in state_dict: "module\.',
        harm="model.pt holds the DDP wrapper's state dict: every name starts with 'module.'",
        notice="loading model.pt into the plain model outside the job fails: missing keys, unexpected 'module.' keys",
    ),
    Mistake(
        name="checkpoint-written-in-place",
        path="common/safe_io.py",
        edits={"    save_torch(obj, path, overwrite=True)\n": "    torch.save(obj, path)\n"},
        test="tests/test_outputs.py::test_every_file_write_goes_through_common_outputs",
        reason=r"common/safe_io\.py:\d+",
        harm="a job killed while saving leaves a truncated step-N.pt or model.pt under its final name, over the "
        "good one",
        notice="after a crash or time limit during a save, --resume fails on a damaged checkpoint",
    ),
]

MISTAKES: list[Mistake] = [*CHECKPOINTS, *SIGNALS, *IN_FLIGHT, *LOCKS, *RESTARTS, *FINAL_MODEL]
