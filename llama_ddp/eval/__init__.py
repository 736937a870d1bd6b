"""Numbers about a model: multiple-choice tasks (tasks, stdlib_task) scored as lm-evaluation-harness
does (scoring), perplexity of a text or of documents (perplexity), and the scoring windows
(windows); the evaluate command is llama_ddp/evaluate.py. Imports distributed/, data/, model/,
attention_plan/ and the package's top.
"""
