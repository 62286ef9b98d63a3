"""The zoo: classic DDP and FSDP mistakes, each a small patch, each caught by a named test.

``python -m tests.zoo`` applies each mistake to a fresh copy of the repository, runs the test that
should catch it there, and reports caught (that test failed, for the reason the zoo names) or
survived. The mistakes are in ``tests/zoo/catalogue.py``; the runner in ``tests/zoo/__main__.py``.
"""
