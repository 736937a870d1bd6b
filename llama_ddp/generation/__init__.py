"""Text from a model: sampling with a KV cache (generate), chat templates (chat); the generate
command is llama_ddp/generate.py. Imports data/, model/ and the package's top.
"""
