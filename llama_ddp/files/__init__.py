"""Files at the edge: safe writes and reads (safe_io), the Hugging Face hub cache (hub), GGUF files
(gguf). The bottom layer: imports nothing of llama_ddp but errors.
"""
