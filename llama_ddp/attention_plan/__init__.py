"""The batch-layout contract between the data layer, which builds batches, and the model, which
reads them: the attention plan of a batch and the label nothing is learned from (plan), and the
binding to torch's flash varlen kernel, which says whether a device runs it (varlen). Imports only
torch and errors.
"""
