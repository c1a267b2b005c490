"""Reading and writing the data that flows between stages: corpora, JSONL, packed sequences."""
