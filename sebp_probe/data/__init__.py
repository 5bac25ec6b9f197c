"""Data: models and tokenizers (assets), data sets and tokenizing (textdata), the layouts' parts (batching, mlm)
and a run's loaders per layout (train_data)."""
