"""What a training script runs, and nothing else: copy this folder with the script you start from.

Process groups and torchrun's variables (distributed); flags (cli, flags) and their checks, recorded
for each checkpoint (flag_checks); data (data; tokens for text and token files; mnist for the MNIST
scripts' images, CNN and evaluation); the GPT and its wrap helpers (models), fine-tuning; the loop's
pieces (training), the run's bookkeeping, metrics and stop requests (bookkeeping), what a step sends
(collectives); checkpoints and what a resume may change (checkpoint; safe_io, the tensors in and out;
safetensors_weights); the run folder (run_dir) and the one write path (outputs); torch's versions
(distributed). The commands live in tools/, which imports this library; nothing here imports tools
(tests/test_layout.py checks both).
"""
