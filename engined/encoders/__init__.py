"""Embeddings and scores: encoder models, and the pooling that turns a forward's rows into results.

An encoder folder gets an engine of its own (``engine.EncoderEngine``, which the daemon runs in
the decoder ``Engine``'s place) over a sentence-transformers model (``text``: the ``bert`` and
``modernbert`` families). A decoder's embed and score requests run through the ordinary step; it
enters ``pooling`` only for a batch that holds one, once the forward has run.
"""
