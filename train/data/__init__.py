"""Input data: tokenizers, document sources, and the packed, resumable grain pipeline."""
