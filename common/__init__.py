"""What a training script runs, and nothing else: copy this folder with the script you start from.

Process groups (distributed), flags (cli, flags, flag_checks), data (data, tokens), models, the
training loop's bookkeeping (training, metrics), checkpoints (checkpoint, saving, safe_loading) and
the files a run writes (run_dir, outputs). The commands that work with scripts and their runs live in
tools/, which imports this library; nothing here imports tools (tests/test_layout.py checks it).
"""
