"""Numbers about a model: multiple-choice tasks (tasks, stdlib_task) scored as lm-evaluation-harness
does (scoring), perplexity of a text (perplexity), and the scoring windows (windows). Imports
interop/, data/, model/, files/ and the package's top.
"""
