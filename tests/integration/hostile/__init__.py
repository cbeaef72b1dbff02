"""A corpus of hostile stores (see corpus.py), in the manner of safetensors' attacks/."""
