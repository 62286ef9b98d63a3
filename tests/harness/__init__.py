"""The test harness: how a test starts a script's ranks, runs it and reads what it wrote (tests/README.md).

Nothing is imported here: the fork server imports ``tests.harness.preload`` through this package, and
it must load torch and ``common`` only, not pytest and the rest of the harness.
"""
