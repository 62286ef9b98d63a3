"""What every training script shares, and the commands that work with its runs.

Two kinds of module live here. The library is what a script imports: process-group setup
(distributed), flags (cli), data (data, tokens), models, evaluation, metrics, checkpoints, and
the recording of collectives (communication). The commands are run as ``python -m common.NAME``
(preflight, check_equivalence, compare_runs, compare_strategies, estimate_memory,
estimate_communication, comm_check, benchmark, prepare_tokens, sample, export_checkpoint); README.md
lists each in one line. A command may import the library, never the reverse, so a copied script
carries no command's flags or tables (tests/test_layout.py checks both rules).
"""
