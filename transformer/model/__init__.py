"""The paper's model: embeddings, attention, the encoder and decoder layers, make_model."""
