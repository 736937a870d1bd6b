"""Every model format in and out: Hugging Face folders (hf), our llama_model.pth/.json (native),
GGUF files (gguf_export; export: any model with its tokenizer, for llama_ddp/export.py, and a
finished run's exports as one set), and ONE loader for every command that reads a model (load).
Imports checkpoint/, data/ (the tokenizer), model/, files/ and the package's top.
"""
