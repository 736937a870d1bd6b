"""The token cache: reading its shards, memory-mapped, and waiting for those still being built
(read); building them in order under a lock per shard (build), in tokenizer processes (workers),
in a background process while training runs (builder). Imports data/tokenizer, files/ and errors.
"""
