"""Training specd's own small model family: tokenizer, target, EAGLE-3 head, MTP head, draft model.

No weights can be downloaded where specd is developed, so it trains its own on a corpus every
machine has (the Python standard library's sources). The same code trains a head for a user's own
target: every stage writes the Hugging Face layout that specd's loaders read.
"""
