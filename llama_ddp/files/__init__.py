"""Files at the edge: safe writes and reads (safe_io), the Hugging Face hub cache (hub), GGUF files
(gguf), and who makes the files every process of a machine reads (preparation). The bottom layer:
imports nothing of llama_ddp but errors.
"""
