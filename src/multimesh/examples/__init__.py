"""Example models for MultiMesh (small GPT-style decoders in Flax NNX and Linen)."""
