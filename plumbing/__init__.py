"""What every layer may import: the command-line runner and its one-line errors
(`cli`, `errors`), storage paths local or on a bucket (`storage`), and the start-up
noise filter (`quiet`, set up explicitly by each package's `__init__`).

It imports nothing from the repository's other packages, which sit above it:
plumbing -> sharding -> model -> pretrain -> launch (`tests/test_import_graph.py`).
"""
