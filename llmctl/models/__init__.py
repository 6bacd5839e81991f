"""Model families, checkpoint loading and the embedded default model."""
