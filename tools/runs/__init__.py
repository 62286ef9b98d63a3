"""What to do with a finished run: compare, draw, sample, export; and token files for the next one."""
