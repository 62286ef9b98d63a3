"""The commands that work with the training scripts and their runs, each run as ``python -m tools.GROUP.NAME``.

checks/: will a script train as it should (preflight, check_equivalence, comm_check). estimates/: what
a job would hold and send, without the hardware (estimate_memory, estimate_communication, simulate).
runs/: what to do with a run's folder (compare_runs, plot, sample, export_checkpoint) and its data
(prepare_tokens). benchmarks/: what the strategies and the harness cost on real ranks (benchmark,
compare_strategies). Shared by several: processes.py starts and stops the scripts, records.py reads
a run's metrics.jsonl, strategies.py tables the strategies, output_checks.py and command_flags.py check
outputs and flags, model_shapes.py sizes a model without building it. These import common/,
never the reverse: a copied script needs none of this.
"""
