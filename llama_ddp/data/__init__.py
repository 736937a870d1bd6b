"""Text -> tokens -> batches: sources and corpora (sources, corpus, embedded_corpus), broken files
named in one line (file_check), the tokenizer (tokenizer: training and encoding; tokenizer_files:
its files, roles and chat templates), the token cache (cache/: reading it, building it, its
workers and its background builder), mixtures and the sampler (mixture), batches and reading them
a step ahead (batch), and the pipeline that composes them from a run's DataSettings (sources;
pipeline). Imports the package's top (errors, precision), attention_plan/ and files/; never
model, distributed or train (tests/test_layering.py checks).
"""
