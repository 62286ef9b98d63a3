"""Will a script train as it should: before a cluster hangs on it, and beside one process."""
