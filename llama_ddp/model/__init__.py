"""The network alone: the Llama (llama), its config and presets (config), attention (attention), the
loss (loss), state dicts in and out of the model (weights). Imports the package's top (errors,
precision), attention_plan/ and files/; nothing of data, distributed, checkpoint, interop, eval
or train.
It knows nothing of distribution or data; the one file it reads and writes, its config's JSON
(config), goes through files.safe_io.
"""
