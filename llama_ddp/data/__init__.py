"""Text -> tokens -> batches: sources and corpora (sources, corpus, embedded_corpus), the tokenizer
(tokenizer), the token cache, its shards and its background builder (cache, shards, builder),
mixtures and the sampler (mixture), batches (batch), and the pipeline that composes them from a
DataSettings (pipeline). Imports the package's top (errors, layout) and files/; never model,
distributed or train (tests/data/test_layering.py checks).
"""
