"""Text from a model: sampling with a KV cache and the generate command (generate), chat templates
(chat). Imports eval/, interop/, data/, model/, files/ and the package's top.
"""
