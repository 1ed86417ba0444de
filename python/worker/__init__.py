"""The worker: model loading, the persistent batch, attention, the forward pass, sampling."""
