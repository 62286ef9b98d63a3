"""Mistakes in the wrap and the step's numbers: precision, FSDP units and meshes, clipping, and
collectives that only some ranks call."""

from __future__ import annotations

from tests.zoo.mistake import Mistake

FSDP1 = "fsdp/train_transformer.py"
FSDP2 = "fsdp/train_transformer_fsdp2.py"
WRAP_TESTS = "tests/test_wrap_choices.py"
# The equivalence tests' verdict when a run leaves the noise band of one process.
TRAINS_DIFFERENTLY = r"DIFFERENT"
# The pre-flight's verdict when the ranks would not issue the same collectives, on a bounded wait.
RANKS_DISAGREE = r"pre-flight: (MISMATCH at collective|rank \d would issue collective|rank \d waited for rank \d at)"


def preflight_of(script: str) -> str:
    return f"tests/test_preflight.py::test_unbroken_script_passes[{script}]"


PRECISION = [
    Mistake(
        name="fsdp1-reduce-gradients-in-bf16",
        path=FSDP1,
        edits={"reduce_dtype=torch.float32),": "reduce_dtype=compute_dtype),"},
        test=f"{WRAP_TESTS}::test_bf16_computes_in_bf16_and_reduces_gradients_in_fp32[{FSDP1}]",
        reason=r"gradients reduced in \['torch.bfloat16'\], not only fp32",
        harm="the ranks' gradients are summed in bf16, whose 8 significant bits round away the small "
        "contributions; the error grows with the number of GPUs",
        notice="the loss curve is a little worse at 64 GPUs than at 8 with the same global batch, and nothing fails",
    ),
    Mistake(
        name="fsdp2-reduce-gradients-in-bf16",
        path=FSDP2,
        # Leaving reduce_dtype out reduces in param_dtype: the policy's default.
        edits={"param_dtype=torch.bfloat16, reduce_dtype=torch.float32)": "param_dtype=torch.bfloat16)"},
        test=f"{WRAP_TESTS}::test_bf16_computes_in_bf16_and_reduces_gradients_in_fp32[{FSDP2}]",
        reason=r"gradients reduced in \['torch.bfloat16'\], not only fp32",
        harm="the reduce-scatter sums the ranks' gradients in bf16, losing precision as the world grows",
        notice="a bf16 run drifts from an fp32 one more on many GPUs than on few; half the reduce-scatter traffic",
    ),
    Mistake(
        name="fsdp1-keep-low-precision-grads",
        path=FSDP1,
        edits={
            "reduce_dtype=torch.float32),": "reduce_dtype=torch.float32, keep_low_precision_grads=True),",
        },
        test=f"{WRAP_TESTS}::test_bf16_computes_in_bf16_and_reduces_gradients_in_fp32[{FSDP1}]",
        reason=r"the optimizer and the clip see gradients in \{'torch.bfloat16'\}",
        harm="the gradients stay in bf16 after the reduction: the clip's global norm and AdamW's moments "
        "are computed from rounded values",
        notice="the logged grad norm moves in coarse steps, and small updates vanish late in training",
    ),
    Mistake(
        name="fsdp1-fp16-without-loss-scaling",
        path=FSDP1,
        edits={'enabled=args.mixed_precision == "fp16")': "enabled=False)"},
        test=f"{WRAP_TESTS}::test_fp16_scales_the_loss",
        reason=r"fp16 trained without a loss scale",
        harm="fp16 gradients are not scaled up before backward: the small ones flush to zero and those "
        "weights stop learning",
        notice="an fp16 run's loss stalls above a bf16 or fp32 run's; the logged grad norm is smaller",
    ),
    Mistake(
        name="fsdp1-accumulate-in-bf16-under-no-sync",
        path=FSDP1,
        edits={
            'with nullcontext() if last_micro_step or args.mixed_precision != "fp32" else model.no_sync():': (
                "with nullcontext() if last_micro_step else model.no_sync():"
            )
        },
        test="tests/test_hot_path.py::test_fsdp1_accumulates_gradients_in_fp32_under_mixed_precision",
        reason=r"torch\.bfloat16",
        harm="under no_sync FSDP1 adds the micro-steps' unsharded gradients up in bf16, rounding each sum, "
        "before the one reduction",
        notice="with --grad-accum-steps and bf16 the run trains a little worse than without accumulation",
    ),
]

UNITS = [
    Mistake(
        name="fsdp1-a-unit-per-linear",
        path=FSDP1,
        edits={"return module in layers": "return isinstance(module, torch.nn.Linear)"},
        test=f"{WRAP_TESTS}::test_each_block_and_the_root_is_one_unit[{FSDP1}]",
        reason=r"a forward gathers \d+ units, not one per Block and the root",
        harm="every Linear layer is gathered and reduced on its own: many small collectives, each "
        "paying the network's latency, and the norms and embeddings are left to the root, gathered all step",
        notice="the step is slower than with one unit per Block, and the profile shows many short all-gathers",
    ),
    Mistake(
        name="fsdp2-a-unit-per-linear",
        path=FSDP2,
        edits={
            "for layer in layers:": (
                "for layer in [module for module in model.modules() if isinstance(module, torch.nn.Linear)]:"
            )
        },
        test=f"{WRAP_TESTS}::test_each_block_and_the_root_is_one_unit[{FSDP2}]",
        reason=r"a forward gathers \d+ units, not one per Block and the root",
        harm="each Linear layer is sharded and gathered on its own: many small collectives instead of one per Block",
        notice="the step is slower than with one unit per Block, and the profile shows many short all-gathers",
    ),
    Mistake(
        name="fsdp2-root-not-sharded",
        path=FSDP2,
        edits={"    fully_shard(model, **fsdp_options)\n": ""},
        test=f"{WRAP_TESTS}::test_fsdp2_shards_every_parameter",
        reason=r"not sharded: \[.*'tok_emb.weight'",
        harm="the embeddings, final norm and head stay whole plain tensors on every rank and their "
        "gradients are never averaged across ranks",
        notice="the run stops at the first step (the model has no set_requires_gradient_sync, or the "
        "clip mixes DTensors and tensors)",
    ),
]

MESHES = [
    Mistake(
        name="fsdp1-hsdp-mesh-dims-swapped",
        path=FSDP1,
        edits={
            "ctx.device.type, (args.replicate_degree, shard_degree),": (
                "ctx.device.type, (shard_degree, args.replicate_degree),"
            )
        },
        test=f"{WRAP_TESTS}::test_hsdp_shards_within_a_replica_and_reduces_across_replicas[fsdp1]",
        reason=r"sharded across groups of \{.*\}, not 4",
        harm="with --replicate-degree 2 on 8 GPUs, copies are sharded 2 ways and replicated 4 times: "
        "twice the memory per GPU the flag promised",
        notice="the memory per GPU is that of --replicate-degree 4, not 2, on 8 GPUs: R acts as N/R",
    ),
    Mistake(
        name="fsdp2-hsdp-mesh-dims-swapped",
        path=FSDP2,
        edits={
            "shape, dim_names = (args.replicate_degree, shard_degree),": (
                "shape, dim_names = (shard_degree, args.replicate_degree),"
            )
        },
        test=f"{WRAP_TESTS}::test_hsdp_shards_within_a_replica_and_reduces_across_replicas[fsdp2]",
        reason=r"sharded across groups of \{.*\}, not 4",
        harm="with --replicate-degree 2 on 8 GPUs, copies are sharded 2 ways and replicated 4 times: "
        "twice the memory per GPU the flag promised",
        notice="the memory per GPU is that of --replicate-degree 4, not 2, on 8 GPUs: R acts as N/R",
    ),
]

CLIPPING = [
    Mistake(
        name="fsdp2-clip-each-shard-by-its-own-norm",
        path=FSDP2,
        edits={
            "torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf).full_tensor()": (
                "torch.nn.utils.get_total_norm(local_grads := [p.grad.to_local() for p in model.parameters()])\n"
                "    torch.nn.utils.clip_grads_with_norm_(local_grads, args.grad_clip or math.inf, grad_norm)"
            )
        },
        test="tests/test_equivalence.py::test_transformer_matches_one_process[fsdp2-2]",
        reason=TRAINS_DIFFERENTLY,
        harm="each rank clips its slice of the gradients by its own slice's norm: the global norm is never "
        "computed, and the shards of one gradient are scaled differently",
        notice="the logged grad norm is about 1/sqrt(N) of a one-GPU run's, and falls further as you add GPUs",
    ),
    Mistake(
        name="fsdp2-add-the-shards-norms",
        path=FSDP2,
        edits={
            "torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf).full_tensor()": (
                "torch.nn.utils.get_total_norm(local_grads := [p.grad.to_local() for p in model.parameters()])\n"
                "    dist.all_reduce(grad_norm)  # every rank's part of the norm\n"
                "    torch.nn.utils.clip_grads_with_norm_(local_grads, args.grad_clip or math.inf, grad_norm)"
            )
        },
        test="tests/test_equivalence.py::test_transformer_matches_one_process[fsdp2-2]",
        reason=TRAINS_DIFFERENTLY,
        harm="the global norm is taken as the sum of the shards' norms instead of the square root of the "
        "sum of their squares: too large, so every step is clipped harder than it should be",
        notice="the logged grad norm grows with the number of GPUs (about sqrt(N) times a one-GPU run's)",
    ),
]


SOME_RANKS_ONLY = [
    Mistake(
        name="fsdp1-full-state-dict-on-rank-0-only",
        path=FSDP1,
        edits={
            "state = get_model_state_dict(model, options=full_state_dict_options(ctx.device))": (
                "state = get_model_state_dict(model, options=full_state_dict_options(ctx.device)) "
                "if ctx.is_main else None"
            )
        },
        test=preflight_of(FSDP1),
        reason=RANKS_DISAGREE,
        harm="rank 0 waits for the other ranks' shards of the model, which they never send",
        notice="the job hangs after training, with no model.pt, until --dist-timeout ends it",
    ),
    Mistake(
        name="loss-averaged-on-rank-0-only",
        path="common/bookkeeping.py",
        edits={"mean_loss = mean_over_ranks(loss)": "mean_loss = mean_over_ranks(loss) if self.ctx.is_main else 0.0"},
        test=preflight_of("ddp/train_transformer.py"),
        reason=RANKS_DISAGREE,
        harm="rank 0 averages the logged loss over ranks alone: its all-reduce meets the others' next "
        "collective, which hangs or mixes unrelated tensors",
        notice="the job hangs at the first logging step, or logs a loss that makes no sense",
    ),
    Mistake(
        name="final-record-on-rank-0-only",
        path="ddp/train_mnist.py",
        edits={
            "    run.finish(model, optimizer, record)": (
                "    if ctx.is_main:\n        run.finish(model, optimizer, record)"
            )
        },
        test=preflight_of("ddp/train_mnist.py"),
        reason=RANKS_DISAGREE,
        harm="only rank 0 writes the final record, but its memory figures are a maximum over ranks that "
        "the others never join",
        notice="the job trains, saves model.pt, then hangs at the end until --dist-timeout",
    ),
]

DDP = [
    Mistake(
        name="ddp-forward-through-model-module",
        path="ddp/train_transformer.py",
        edits={"logits = model(inputs)": "logits = model.module(inputs)"},
        test="tests/test_equivalence.py::test_transformer_matches_one_process[ddp-2]",
        reason=TRAINS_DIFFERENTLY,
        harm="the forward bypasses DDP, so backward never all-reduces: each rank trains its own copy on "
        "its own data, and model.pt is rank 0's copy",
        notice="the loss is noisier than the global batch implies, and the ranks' copies differ when compared",
    ),
]

FSDP2_TP = "fsdp/train_transformer_fsdp2_tp.py"
TP_ALONE = "tests/test_tensor_parallel.py::test_tensor_parallel_alone_1x2_matches_one_process"
# The TP tests' first check: step 1 against one process's, before the run's own exit code and the comparison.
TP_STEP_1 = r"the tensor-parallel split \(each tensor's placement, each rank's share of the batch\) does not compute"
TENSOR_PARALLEL = [
    Mistake(
        name="tp-batch-split-for-the-sequence",
        path=FSDP2_TP,
        edits={
            '"drop": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),': (
                '"drop": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),'
            )
        },
        test=TP_ALONE,
        reason=TP_STEP_1,
        harm="each rank of a group keeps half of the batch where it should keep half of every sequence; the Blocks "
        "take it for a slice of the sequence and gather two sequences' halves into one: attention and the loss "
        "meet the wrong positions, and the token counts still add up, so nothing fails",
        notice="training runs and the loss falls, more slowly than without TP, from the first step; evaluation "
        "crashes only where a batch does not split evenly",
    ),
    Mistake(
        name="tp-fused-qkv-split-as-one-weight",
        path=FSDP2_TP,
        edits={'"attn.qkv": tp.FusedColwiseParallel(parts=3),': '"attn.qkv": ColwiseParallel(),'},
        test=TP_ALONE,
        reason=TP_STEP_1,
        harm="a plain column-wise split of the fused q|k|v weight gives rank 0 all of q and half of k: each rank's "
        "heads attend with another head's keys, and the model is no longer the one described",
        notice="the loss falls more slowly than without TP from the first step; nothing fails, shapes all fit",
    ),
    Mistake(
        name="tp-row-wise-layer-split-by-its-outputs",
        path=FSDP2_TP,
        edits={
            '"mlp.proj": RowwiseParallel(output_layouts=Shard(1)),': (
                '"mlp.proj": ColwiseParallel(output_layouts=Shard(1)),'
            )
        },
        test=TP_ALONE,
        reason=r"a and b must have same reduction dim",
        harm="the MLP's second layer is cut along its outputs instead of its inputs: it receives a slice of the "
        "hidden units where it expects them all",
        notice="the first forward fails on a shape mismatch in the MLP, on every rank",
    ),
    Mistake(
        name="tp-group-ranks-draw-different-batches",
        path=FSDP2_TP,
        edits={
            "sampler = CompactDistributedSampler(data.train, dp_size, dp_rank, seed=args.seed)": (
                "sampler = CompactDistributedSampler(data.train, ctx.world_size, ctx.rank, seed=args.seed)"
            )
        },
        test=TP_ALONE,
        reason=TP_STEP_1,
        harm="the ranks of a tensor-parallel group compute one layer together on different examples: each adds "
        "its partial sums to another example's, and the loss meets targets the logits were not computed for",
        notice="the loss is far above a run without TP, and the ranks of a group log different losses",
    ),
    Mistake(
        name="tp-loss-on-local-logits",
        path=FSDP2_TP,
        edits={"output_layouts=Shard(-1), use_local_output=False)": "output_layouts=Shard(-1))"},
        test=TP_ALONE,
        reason=r"Target \d+ is out of bounds",
        harm="the split head hands back plain local logits, each rank's slice of the vocabulary, and the loss "
        "reads them as if they were all of it: no rank ever sees the logits of the targets in another's slice",
        notice="on CPU the loss stops on a target out of bounds; on a GPU, a device-side assert in the loss, or "
        "with a vocabulary padded to the split, a loss that trains on the wrong classes",
    ),
    Mistake(
        name="tp-norm-gradients-not-summed",
        path=FSDP2_TP,
        edits={'        "ln1": SequenceParallel(),\n': "", '        "ln2": SequenceParallel(),\n': ""},
        test=TP_ALONE,
        reason=TP_STEP_1,
        harm="the LayerNorms left out of the plan run on each rank's slice of the sequence as plain modules: "
        "forward is right, but each rank's norm gradient covers its own tokens only and is never summed, so "
        "the copies of the norm weights in a group drift apart",
        notice="nothing fails; the loss drifts from a run without TP after the first steps, and the norm weights "
        "differ between the ranks of a group when compared",
    ),
]

MISTAKES: list[Mistake] = [*DDP, *PRECISION, *UNITS, *MESHES, *CLIPPING, *SOME_RANKS_ONLY, *TENSOR_PARALLEL]
