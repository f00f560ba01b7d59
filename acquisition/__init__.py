"""Getting a model onto this host: MODEL as a local directory, a Hugging Face download or a
GGUF import (weights and tokenizer), cached under MODEL_CACHE_DIR. Nothing here serves."""
